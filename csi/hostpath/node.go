package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// The node service: the kubelet publishes a volume into a Pod by asking for its
// directory at a target path under the kubelet's root dir, and the driver bind-mounts
// it there. The driver runs in the kubelet's mount namespace (both are processes on
// this machine), so the mount is what the container runtime then binds into the
// container. There is no staging step: a directory needs no per-node preparation, so
// NodeGetCapabilities offers no STAGE_UNSTAGE_VOLUME and the kubelet publishes directly.

func (d *driver) NodeGetInfo(context.Context, *csi.NodeGetInfoRequest) (*csi.NodeGetInfoResponse, error) {
	// No accessible topology: every node of the local cluster is this machine.
	return &csi.NodeGetInfoResponse{NodeId: d.nodeID}, nil
}

func (d *driver) NodeGetCapabilities(context.Context, *csi.NodeGetCapabilitiesRequest) (*csi.NodeGetCapabilitiesResponse, error) {
	return &csi.NodeGetCapabilitiesResponse{}, nil
}

func (d *driver) NodePublishVolume(_ context.Context, req *csi.NodePublishVolumeRequest) (*csi.NodePublishVolumeResponse, error) {
	switch {
	case req.GetVolumeId() == "":
		return nil, status.Error(codes.InvalidArgument, "volume_id is required")
	case req.GetTargetPath() == "":
		return nil, status.Error(codes.InvalidArgument, "target_path is required")
	case !filepath.IsAbs(req.GetTargetPath()):
		return nil, status.Errorf(codes.InvalidArgument, "target_path %q must be an absolute path", req.GetTargetPath())
	case req.GetVolumeCapability() == nil:
		return nil, status.Error(codes.InvalidArgument, "volume_capability is required")
	}
	vc := req.GetVolumeCapability()
	if vc.GetBlock() != nil {
		return nil, status.Error(codes.InvalidArgument, "volume_capability.block: block volumes are not supported, volumes are directories")
	}
	if vc.GetMount() == nil {
		return nil, status.Error(codes.InvalidArgument, "volume_capability.access_type: mount is required")
	}
	if flags := vc.GetMount().GetMountFlags(); len(flags) > 0 {
		// A bind-mounted directory has no file system of its own to pass them to;
		// failing says so instead of silently dropping a PV's mountOptions.
		return nil, status.Errorf(codes.InvalidArgument, "volume_capability.mount.mount_flags %q: not supported, volumes are bind-mounted directories", flags)
	}
	readonly := req.GetReadonly()
	switch vc.GetAccessMode().GetMode() {
	case csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY, csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY:
		readonly = true
	}

	// The store lock is held only for the lookup: a long CreateSnapshot holds it, and a
	// Pod's mount should not wait for an unrelated archive.
	d.mu.Lock()
	_, ok := d.store.volumes[req.GetVolumeId()]
	source := d.store.volumePath(req.GetVolumeId())
	d.mu.Unlock()
	if !ok {
		return nil, status.Errorf(codes.NotFound, "volume %q not found", req.GetVolumeId())
	}

	d.nodeMu.Lock()
	defer d.nodeMu.Unlock()
	target := req.GetTargetPath()
	if err := os.MkdirAll(target, 0o750); err != nil {
		return nil, status.Errorf(codes.Internal, "creating target_path: %v", err)
	}
	m, err := mountAt(target)
	if err != nil {
		return nil, status.Errorf(codes.Internal, "reading mounts: %v", err)
	}
	if m != nil {
		// Published before (a retry, or a restarted kubelet): fine if it is this volume
		// with the same access, a conflict otherwise.
		same, err := sameDir(source, target)
		if err != nil {
			return nil, status.Errorf(codes.Internal, "comparing %s with target_path: %v", source, err)
		}
		if !same {
			return nil, status.Errorf(codes.AlreadyExists, "target_path %s already has another mount", target)
		}
		if m.readonly != readonly {
			return nil, status.Errorf(codes.AlreadyExists, "volume %s is already published at %s with readonly=%v", req.GetVolumeId(), target, m.readonly)
		}
		return &csi.NodePublishVolumeResponse{}, nil
	}
	if err := unix.Mount(source, target, "", unix.MS_BIND, ""); err != nil {
		return nil, status.Errorf(codes.Internal, "bind-mounting %s at %s: %v", source, target, err)
	}
	if readonly {
		// A bind mount takes the source's flags; read-only needs a second, remounting call.
		if err := unix.Mount("", target, "", unix.MS_BIND|unix.MS_REMOUNT|unix.MS_RDONLY, ""); err != nil {
			_ = unix.Unmount(target, 0)
			return nil, status.Errorf(codes.Internal, "remounting %s read-only: %v", target, err)
		}
	}
	return &csi.NodePublishVolumeResponse{}, nil
}

// NodeUnpublishVolume unmounts whatever is at the target path and removes the folder.
// It does not look the volume up: a volume deleted while still mounted must still be
// unmountable, and a repeated call finds nothing to do and succeeds.
func (d *driver) NodeUnpublishVolume(_ context.Context, req *csi.NodeUnpublishVolumeRequest) (*csi.NodeUnpublishVolumeResponse, error) {
	switch {
	case req.GetVolumeId() == "":
		return nil, status.Error(codes.InvalidArgument, "volume_id is required")
	case req.GetTargetPath() == "":
		return nil, status.Error(codes.InvalidArgument, "target_path is required")
	}
	target := req.GetTargetPath()

	d.nodeMu.Lock()
	defer d.nodeMu.Unlock()
	// A publish repeated outside this driver may have stacked mounts; take them all off.
	for range 16 {
		m, err := mountAt(target)
		if err != nil {
			return nil, status.Errorf(codes.Internal, "reading mounts: %v", err)
		}
		if m == nil {
			break
		}
		if err := unix.Unmount(target, 0); err != nil {
			return nil, status.Errorf(codes.Internal, "unmounting %s: %v", target, err)
		}
	}
	// os.Remove, never RemoveAll: if a mount were still there, RemoveAll would delete
	// the workspace's files through it.
	if err := os.Remove(target); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, status.Errorf(codes.Internal, "removing target_path: %v", err)
	}
	return &csi.NodeUnpublishVolumeResponse{}, nil
}

// sameDir says whether two paths are the same directory: a bind mount's root has the
// source's device and inode.
func sameDir(a, b string) (bool, error) {
	var sa, sb unix.Stat_t
	if err := unix.Stat(a, &sa); err != nil {
		return false, err
	}
	if err := unix.Stat(b, &sb); err != nil {
		return false, err
	}
	return sa.Dev == sb.Dev && sa.Ino == sb.Ino, nil
}

type mountEntry struct {
	readonly bool
}

// mountAt returns the topmost mount whose mount point is path, or nil when path is
// not a mount point (or does not exist). It reads /proc/self/mountinfo: unlike a
// device-number comparison with the parent, that also sees a bind mount from the
// same file system.
func mountAt(path string) (*mountEntry, error) {
	resolved, err := filepath.EvalSymlinks(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return findMount(bufio.NewScanner(f), resolved)
}

// findMount scans mountinfo lines ("36 35 98:0 /root /mnt/point rw,noatime master:1 - ext3 /dev/root rw")
// for the last mount at mountPoint; later lines are mounted on top of earlier ones.
func findMount(sc *bufio.Scanner, mountPoint string) (*mountEntry, error) {
	var found *mountEntry
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 6 {
			return nil, fmt.Errorf("malformed mountinfo line %q", sc.Text())
		}
		if unescapeMountPath(fields[4]) != mountPoint {
			continue
		}
		found = &mountEntry{readonly: hasOption(fields[5], "ro")}
	}
	return found, sc.Err()
}

func hasOption(options, want string) bool {
	for _, o := range strings.Split(options, ",") {
		if o == want {
			return true
		}
	}
	return false
}

// unescapeMountPath undoes the kernel's octal escapes of space, tab, newline and
// backslash in mountinfo paths.
func unescapeMountPath(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+4 <= len(s) {
			if n, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(n))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}
