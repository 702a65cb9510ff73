package main

import (
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"log"
	"os"
	"path/filepath"
	"strings"
	"time"
)

// The state directory:
//
//	<statedir>/volumes/<volume-id>/        a volume's files (what a sandbox sees)
//	<statedir>/snapshots/<snapshot-id>.tgz a snapshot's archive
//	<statedir>/meta/volumes/<id>.json      what the driver knows about each of them,
//	<statedir>/meta/snapshots/<id>.json    so a restarted driver keeps working
//
// Data is moved into place before its metadata is written, so an object with metadata
// is always complete; a crash in between leaves an orphan that is logged, never used.

type volume struct {
	ID            string    `json:"id"`
	Name          string    `json:"name"`
	CapacityBytes int64     `json:"capacityBytes"`
	SourceSnap    string    `json:"sourceSnapshotId,omitempty"`
	SourceVolume  string    `json:"sourceVolumeId,omitempty"`
	Created       time.Time `json:"created"`
}

type snapshot struct {
	ID             string `json:"id"`
	Name           string `json:"name"`
	SourceVolumeID string `json:"sourceVolumeId"`
	// SizeBytes is the source volume's capacity, not the archive's size: CSI defines it
	// as the smallest volume the snapshot can be restored into.
	SizeBytes   int64     `json:"sizeBytes"`
	ArchiveSize int64     `json:"archiveBytes"`
	Created     time.Time `json:"created"`
}

// store holds the metadata in memory and writes every change through to disk. It is
// not safe for concurrent use; the driver serialises calls.
type store struct {
	dir       string
	volumes   map[string]*volume
	snapshots map[string]*snapshot
}

func openStore(dir string) (*store, error) {
	dir, err := filepath.Abs(dir)
	if err != nil {
		return nil, err
	}
	s := &store{dir: dir, volumes: map[string]*volume{}, snapshots: map[string]*snapshot{}}
	for _, sub := range []string{"volumes", "snapshots", "meta/volumes", "meta/snapshots"} {
		if err := os.MkdirAll(filepath.Join(dir, sub), 0o755); err != nil {
			return nil, err
		}
	}
	if err := loadAll(filepath.Join(dir, "meta/volumes"), s.volumes); err != nil {
		return nil, err
	}
	if err := loadAll(filepath.Join(dir, "meta/snapshots"), s.snapshots); err != nil {
		return nil, err
	}
	s.sweep()
	log.Printf("state: %d volumes, %d snapshots", len(s.volumes), len(s.snapshots))
	return s, nil
}

func loadAll[T any](dir string, into map[string]*T) error {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	for _, e := range entries {
		id, ok := strings.CutSuffix(e.Name(), ".json")
		if !ok {
			continue
		}
		data, err := os.ReadFile(filepath.Join(dir, e.Name()))
		if err != nil {
			return err
		}
		obj := new(T)
		if err := json.Unmarshal(data, obj); err != nil {
			return fmt.Errorf("%s: %w", e.Name(), err)
		}
		into[id] = obj
	}
	return nil
}

// sweep removes half-written temporaries from a previous run and reports orphans.
func (s *store) sweep() {
	for _, sub := range []string{"volumes", "snapshots"} {
		entries, _ := os.ReadDir(filepath.Join(s.dir, sub))
		for _, e := range entries {
			name := e.Name()
			if strings.HasPrefix(name, ".tmp-") {
				_ = os.RemoveAll(filepath.Join(s.dir, sub, name))
				continue
			}
			id := strings.TrimSuffix(name, ".tgz")
			if _, known := s.volumes[id]; sub == "volumes" && !known {
				log.Printf("orphan volume directory without metadata (left alone): %s", name)
			}
			if _, known := s.snapshots[id]; sub == "snapshots" && !known {
				log.Printf("orphan snapshot archive without metadata (left alone): %s", name)
			}
		}
	}
}

func (s *store) volumePath(id string) string   { return filepath.Join(s.dir, "volumes", id) }
func (s *store) snapshotPath(id string) string { return filepath.Join(s.dir, "snapshots", id+".tgz") }

// tempPath is where an object is built before it is renamed into place; same
// filesystem as the final path, so the rename is atomic.
func (s *store) tempPath(kind, id string) string {
	return filepath.Join(s.dir, kind, ".tmp-"+id)
}

func (s *store) volumeByName(name string) *volume {
	for _, v := range s.volumes {
		if v.Name == name {
			return v
		}
	}
	return nil
}

func (s *store) snapshotByName(name string) *snapshot {
	for _, sn := range s.snapshots {
		if sn.Name == name {
			return sn
		}
	}
	return nil
}

func (s *store) putVolume(v *volume) error {
	if err := writeJSON(filepath.Join(s.dir, "meta/volumes", v.ID+".json"), v); err != nil {
		return err
	}
	s.volumes[v.ID] = v
	return nil
}

func (s *store) putSnapshot(sn *snapshot) error {
	if err := writeJSON(filepath.Join(s.dir, "meta/snapshots", sn.ID+".json"), sn); err != nil {
		return err
	}
	s.snapshots[sn.ID] = sn
	return nil
}

// deleteVolume removes metadata first: from then on the volume does not exist, and a
// crash before its directory is gone leaves only an orphan, never a broken volume.
func (s *store) deleteVolume(id string) error {
	if err := removeIfExists(filepath.Join(s.dir, "meta/volumes", id+".json")); err != nil {
		return err
	}
	delete(s.volumes, id)
	return os.RemoveAll(s.volumePath(id))
}

func (s *store) deleteSnapshot(id string) error {
	if err := removeIfExists(filepath.Join(s.dir, "meta/snapshots", id+".json")); err != nil {
		return err
	}
	delete(s.snapshots, id)
	return removeIfExists(s.snapshotPath(id))
}

func writeJSON(path string, v any) error {
	data, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, append(data, '\n'), 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

func removeIfExists(path string) error {
	if err := os.Remove(path); err != nil && !os.IsNotExist(err) {
		return err
	}
	return nil
}

// newID returns a random id with a prefix that says what it names in logs and paths.
func newID(prefix string) string {
	b := make([]byte, 8)
	_, _ = rand.Read(b)
	return prefix + hex.EncodeToString(b)
}
