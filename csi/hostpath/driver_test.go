package main

import (
	"archive/tar"
	"bytes"
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

var mountCap = []*csi.VolumeCapability{{
	AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}},
	AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
}}

func newDriver(t *testing.T, dir string) *driver {
	t.Helper()
	s, err := openStore(dir)
	if err != nil {
		t.Fatal(err)
	}
	return &driver{name: "test", nodeID: "n", store: s}
}

// must keeps the calls below on one line; a panic fails the test with its stack.
func must[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}

func writeFile(t *testing.T, path, data string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte(data), 0o640); err != nil {
		t.Fatal(err)
	}
}

func readFile(t *testing.T, path string) string {
	t.Helper()
	return string(must(os.ReadFile(path)))
}

func TestSnapshotRestoreCloneAndRestart(t *testing.T) {
	ctx, dir := context.Background(), t.TempDir()
	d := newDriver(t, dir)

	vol := must(d.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc-a", VolumeCapabilities: mountCap,
		CapacityRange: &csi.CapacityRange{RequiredBytes: 1 << 20}})).Volume
	again := must(d.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc-a", VolumeCapabilities: mountCap})).Volume
	if again.VolumeId != vol.VolumeId {
		t.Fatalf("CreateVolume is not idempotent by name: %s then %s", vol.VolumeId, again.VolumeId)
	}
	src := d.store.volumePath(vol.VolumeId)
	writeFile(t, filepath.Join(src, "top.txt"), "one")
	writeFile(t, filepath.Join(src, "nested/deeper/file.txt"), "two")
	if err := os.Symlink("top.txt", filepath.Join(src, "link")); err != nil {
		t.Fatal(err)
	}

	snap := must(d.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "snap-a", SourceVolumeId: vol.VolumeId})).Snapshot
	if !snap.ReadyToUse || snap.SizeBytes != 1<<20 {
		t.Fatalf("snapshot: ready=%v size=%d", snap.ReadyToUse, snap.SizeBytes)
	}
	writeFile(t, filepath.Join(src, "top.txt"), "changed")

	// A restarted driver knows the snapshot by name and can restore it.
	d = newDriver(t, dir)
	if again := must(d.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "snap-a", SourceVolumeId: vol.VolumeId})).Snapshot; again.SnapshotId != snap.SnapshotId {
		t.Fatalf("CreateSnapshot is not idempotent across a restart")
	}
	restored := must(d.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc-b", VolumeCapabilities: mountCap,
		CapacityRange: &csi.CapacityRange{RequiredBytes: 1 << 20},
		VolumeContentSource: &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{
			Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: snap.SnapshotId}}}})).Volume
	dst := d.store.volumePath(restored.VolumeId)
	if got := readFile(t, filepath.Join(dst, "top.txt")); got != "one" {
		t.Fatalf("restored top.txt = %q", got)
	}
	if got := readFile(t, filepath.Join(dst, "nested/deeper/file.txt")); got != "two" {
		t.Fatalf("restored nested file = %q", got)
	}
	if info := must(os.Stat(filepath.Join(dst, "top.txt"))); info.Mode().Perm() != 0o640 {
		t.Fatalf("mode not kept: %v", info.Mode())
	}
	if target := must(os.Readlink(filepath.Join(dst, "link"))); target != "top.txt" {
		t.Fatalf("symlink target = %q", target)
	}

	clone := must(d.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc-c", VolumeCapabilities: mountCap,
		CapacityRange: &csi.CapacityRange{RequiredBytes: 1 << 20},
		VolumeContentSource: &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Volume{
			Volume: &csi.VolumeContentSource_VolumeSource{VolumeId: vol.VolumeId}}}})).Volume
	if got := readFile(t, filepath.Join(d.store.volumePath(clone.VolumeId), "top.txt")); got != "changed" {
		t.Fatalf("clone top.txt = %q", got)
	}

	// Restoring into a smaller volume than the snapshot's size is refused.
	_, err := d.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc-small", VolumeCapabilities: mountCap,
		CapacityRange: &csi.CapacityRange{RequiredBytes: 1024},
		VolumeContentSource: &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{
			Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: snap.SnapshotId}}}})
	if status.Code(err) != codes.OutOfRange {
		t.Fatalf("restore into a too-small volume: %v", err)
	}

	list := must(d.ListSnapshots(ctx, &csi.ListSnapshotsRequest{SourceVolumeId: vol.VolumeId}))
	if len(list.Entries) != 1 {
		t.Fatalf("ListSnapshots by source: %d entries", len(list.Entries))
	}
	must(d.DeleteSnapshot(ctx, &csi.DeleteSnapshotRequest{SnapshotId: snap.SnapshotId}))
	must(d.DeleteSnapshot(ctx, &csi.DeleteSnapshotRequest{SnapshotId: snap.SnapshotId})) // idempotent
	if _, err := os.Stat(d.store.snapshotPath(snap.SnapshotId)); !os.IsNotExist(err) {
		t.Fatalf("archive still there after DeleteSnapshot: %v", err)
	}
	must(d.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: vol.VolumeId}))
	if _, err := os.Stat(src); !os.IsNotExist(err) {
		t.Fatalf("volume directory still there after DeleteVolume: %v", err)
	}
}

func TestListSnapshotsPages(t *testing.T) {
	ctx := context.Background()
	d := newDriver(t, t.TempDir())
	vol := must(d.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "v", VolumeCapabilities: mountCap})).Volume
	for _, name := range []string{"s1", "s2", "s3"} {
		must(d.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: name, SourceVolumeId: vol.VolumeId}))
	}
	seen, token := 0, ""
	for range 3 {
		page := must(d.ListSnapshots(ctx, &csi.ListSnapshotsRequest{MaxEntries: 2, StartingToken: token}))
		seen += len(page.Entries)
		if token = page.NextToken; token == "" {
			break
		}
	}
	if seen != 3 {
		t.Fatalf("paged through %d snapshots, want 3", seen)
	}
}

func TestExtractStaysInsideTheVolume(t *testing.T) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	_ = tw.WriteHeader(&tar.Header{Name: "escape", Typeflag: tar.TypeSymlink, Linkname: "..", Mode: 0o777})
	_ = tw.WriteHeader(&tar.Header{Name: "escape/owned.txt", Typeflag: tar.TypeReg, Mode: 0o644, Size: 1})
	_, _ = tw.Write([]byte("x"))
	_ = tw.Close()

	parent := t.TempDir()
	dir := filepath.Join(parent, "vol")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := extractTar(&buf, dir); err == nil {
		t.Fatal("an archive writing through a symlink out of the volume was accepted")
	}
	if _, err := os.Stat(filepath.Join(parent, "owned.txt")); !os.IsNotExist(err) {
		t.Fatalf("file written outside the volume: %v", err)
	}
}
