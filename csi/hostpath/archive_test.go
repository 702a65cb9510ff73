package main

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
)

// A file replaced by rename while the volume is archived is in each archive whole (old
// or new) or absent, never the old file's length over the new file's bytes.
func TestArchiveOfAFileReplacedByRenameIsNeverTorn(t *testing.T) {
	src := t.TempDir()
	write := func(n int) {
		payload := strings.Repeat(fmt.Sprintf("%d,", n), 1+n%997) // a length that changes every time
		sum := sha256.Sum256([]byte(payload))
		tmp := filepath.Join(src, fmt.Sprintf(".busy.%d.tmp", n))
		if err := os.WriteFile(tmp, []byte(hex.EncodeToString(sum[:])+"\n"+payload), 0o644); err != nil {
			t.Error(err)
			return
		}
		if err := os.Rename(tmp, filepath.Join(src, "busy.dat")); err != nil {
			t.Error(err)
		}
	}
	write(0)
	var stop atomic.Bool
	done := make(chan struct{})
	go func() {
		defer close(done)
		for n := 1; !stop.Load(); n++ {
			write(n)
		}
	}()
	defer func() { stop.Store(true); <-done }()

	for i := 0; i < 200; i++ {
		var buf bytes.Buffer
		if err := writeTar(src, &buf); err != nil {
			t.Fatalf("archive %d: %v", i, err)
		}
		dst := t.TempDir()
		if err := extractTar(&buf, dst); err != nil {
			t.Fatalf("extract %d: %v", i, err)
		}
		data, err := os.ReadFile(filepath.Join(dst, "busy.dat"))
		if os.IsNotExist(err) {
			continue
		}
		if err != nil {
			t.Fatal(err)
		}
		head, payload, ok := strings.Cut(string(data), "\n")
		sum := sha256.Sum256([]byte(payload))
		if !ok || head != hex.EncodeToString(sum[:]) {
			t.Fatalf("archive %d holds a torn busy.dat (%d bytes)", i, len(data))
		}
	}
}
