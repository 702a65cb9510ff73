package main

import (
	"bufio"
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// These tests bind-mount for real, so they need root (CAP_SYS_ADMIN), as the driver does.

var mountVC = mountCap[0]

// publishTarget returns a target path under a fresh folder, as the kubelet's
// pods/<uid>/volumes/kubernetes.io~csi/<pv>/mount would be, and unmounts whatever is
// left there when the test ends so the temporary folder's removal never reaches
// through a mount into the volume.
func publishTarget(t *testing.T) string {
	t.Helper()
	target := filepath.Join(t.TempDir(), "pods", "uid", "volumes", "pv", "mount")
	t.Cleanup(func() {
		for range 4 {
			if unix.Unmount(target, unix.MNT_DETACH) != nil {
				return
			}
		}
	})
	return target
}

func newVolume(t *testing.T, d *driver) string {
	t.Helper()
	return must(d.CreateVolume(context.Background(), &csi.CreateVolumeRequest{Name: t.Name(), VolumeCapabilities: mountCap})).Volume.VolumeId
}

func TestPublishBindMountsTheVolume(t *testing.T) {
	ctx := context.Background()
	d := newDriver(t, t.TempDir())
	id := newVolume(t, d)
	source := d.store.volumePath(id)
	writeFile(t, filepath.Join(source, "notes.txt"), "from the volume")
	target := publishTarget(t)

	req := &csi.NodePublishVolumeRequest{VolumeId: id, TargetPath: target, VolumeCapability: mountVC}
	must(d.NodePublishVolume(ctx, req))
	if got := readFile(t, filepath.Join(target, "notes.txt")); got != "from the volume" {
		t.Fatalf("target sees notes.txt = %q", got)
	}
	writeFile(t, filepath.Join(target, "out.txt"), "from the pod")
	if got := readFile(t, filepath.Join(source, "out.txt")); got != "from the pod" {
		t.Fatalf("volume sees out.txt = %q", got)
	}

	// A retried publish finds the mount and succeeds without stacking another.
	must(d.NodePublishVolume(ctx, req))
	if n := mountsAt(t, target); n != 1 {
		t.Fatalf("%d mounts at the target after publishing twice, want 1", n)
	}
	// The same target with other access is a conflict.
	_, err := d.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: id, TargetPath: target, VolumeCapability: mountVC, Readonly: true})
	if status.Code(err) != codes.AlreadyExists {
		t.Fatalf("republish read-only over a read-write mount: %v", err)
	}

	unpub := &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: target}
	must(d.NodeUnpublishVolume(ctx, unpub))
	if n := mountsAt(t, target); n != 0 {
		t.Fatalf("%d mounts at the target after unpublish", n)
	}
	if _, err := os.Stat(target); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("target_path still there after unpublish: %v", err)
	}
	if got := readFile(t, filepath.Join(source, "out.txt")); got != "from the pod" {
		t.Fatalf("volume lost out.txt on unpublish: %q", got)
	}
	must(d.NodeUnpublishVolume(ctx, unpub)) // idempotent: nothing mounted, nothing there
}

func TestPublishReadOnly(t *testing.T) {
	ctx := context.Background()
	d := newDriver(t, t.TempDir())
	id := newVolume(t, d)
	source := d.store.volumePath(id)
	writeFile(t, filepath.Join(source, "notes.txt"), "keep")
	target := publishTarget(t)

	must(d.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: id, TargetPath: target, VolumeCapability: mountVC, Readonly: true}))
	if got := readFile(t, filepath.Join(target, "notes.txt")); got != "keep" {
		t.Fatalf("target sees notes.txt = %q", got)
	}
	err := os.WriteFile(filepath.Join(target, "new.txt"), []byte("x"), 0o644)
	if !errors.Is(err, unix.EROFS) {
		t.Fatalf("write through a read-only publish: %v, want EROFS", err)
	}
	// Only the Pod's view is read-only; the volume itself stays writable.
	writeFile(t, filepath.Join(source, "new.txt"), "x")
	must(d.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: target}))

	// A reader-only access mode publishes read-only too.
	ro := &csi.VolumeCapability{AccessType: mountVC.AccessType,
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY}}
	must(d.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: id, TargetPath: target, VolumeCapability: ro}))
	if err := os.WriteFile(filepath.Join(target, "new.txt"), []byte("y"), 0o644); !errors.Is(err, unix.EROFS) {
		t.Fatalf("write through a SINGLE_NODE_READER_ONLY publish: %v, want EROFS", err)
	}
	must(d.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: target}))
}

func TestPublishRefusesBadRequests(t *testing.T) {
	ctx := context.Background()
	d := newDriver(t, t.TempDir())
	id := newVolume(t, d)
	target := publishTarget(t)
	block := &csi.VolumeCapability{AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}}}
	flags := &csi.VolumeCapability{AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{MountFlags: []string{"noatime"}}}}
	for _, tc := range []struct {
		name string
		req  *csi.NodePublishVolumeRequest
		code codes.Code
		says string
	}{
		{"unknown volume", &csi.NodePublishVolumeRequest{VolumeId: "vol-nope", TargetPath: target, VolumeCapability: mountVC}, codes.NotFound, `"vol-nope"`},
		{"no volume_id", &csi.NodePublishVolumeRequest{TargetPath: target, VolumeCapability: mountVC}, codes.InvalidArgument, "volume_id"},
		{"no target_path", &csi.NodePublishVolumeRequest{VolumeId: id, VolumeCapability: mountVC}, codes.InvalidArgument, "target_path"},
		{"relative target_path", &csi.NodePublishVolumeRequest{VolumeId: id, TargetPath: "rel/mount", VolumeCapability: mountVC}, codes.InvalidArgument, "target_path"},
		{"no volume_capability", &csi.NodePublishVolumeRequest{VolumeId: id, TargetPath: target}, codes.InvalidArgument, "volume_capability"},
		{"block", &csi.NodePublishVolumeRequest{VolumeId: id, TargetPath: target, VolumeCapability: block}, codes.InvalidArgument, "volume_capability.block"},
		{"mount flags", &csi.NodePublishVolumeRequest{VolumeId: id, TargetPath: target, VolumeCapability: flags}, codes.InvalidArgument, "mount_flags"},
	} {
		_, err := d.NodePublishVolume(ctx, tc.req)
		if status.Code(err) != tc.code || !strings.Contains(err.Error(), tc.says) {
			t.Errorf("%s: %v, want %s naming %s", tc.name, err, tc.code, tc.says)
		}
	}
	if n := mountsAt(t, target); n != 0 {
		t.Fatalf("a refused publish left %d mounts", n)
	}
	if _, err := d.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: id}); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("unpublish without target_path: %v", err)
	}
}

func TestNodeGetInfoReportsTheNodeID(t *testing.T) {
	d := newDriver(t, t.TempDir())
	d.nodeID = "savepoint-node"
	if got := must(d.NodeGetInfo(context.Background(), &csi.NodeGetInfoRequest{})).NodeId; got != "savepoint-node" {
		t.Fatalf("NodeGetInfo node id = %q", got)
	}
	// No STAGE_UNSTAGE_VOLUME: the kubelet must publish directly.
	if caps := must(d.NodeGetCapabilities(context.Background(), &csi.NodeGetCapabilitiesRequest{})).Capabilities; len(caps) != 0 {
		t.Fatalf("node capabilities = %v, want none", caps)
	}
}

func TestFindMountReadsEscapedPathsAndTheTopMount(t *testing.T) {
	info := strings.Join([]string{
		`22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw`,
		`40 22 8:1 /srv/vol /var/lib/kubelet/pods/a\040b/mount rw,relatime shared:1 - ext4 /dev/sda1 rw`,
		`41 40 8:1 /srv/vol /var/lib/kubelet/pods/a\040b/mount ro,relatime shared:1 - ext4 /dev/sda1 rw`,
	}, "\n")
	m, err := findMount(bufio.NewScanner(strings.NewReader(info)), "/var/lib/kubelet/pods/a b/mount")
	if err != nil || m == nil || !m.readonly {
		t.Fatalf("findMount = %+v, %v; want the read-only top mount", m, err)
	}
	if m, _ := findMount(bufio.NewScanner(strings.NewReader(info)), "/var/lib/kubelet/pods"); m != nil {
		t.Fatalf("a folder with no mount of its own was reported mounted: %+v", m)
	}
}

// mountsAt counts the mounts whose mount point is path.
func mountsAt(t *testing.T, path string) int {
	t.Helper()
	resolved, err := filepath.EvalSymlinks(path)
	if errors.Is(err, os.ErrNotExist) {
		return 0
	}
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, line := range strings.Split(string(must(os.ReadFile("/proc/self/mountinfo"))), "\n") {
		if f := strings.Fields(line); len(f) > 4 && unescapeMountPath(f[4]) == resolved {
			n++
		}
	}
	return n
}
