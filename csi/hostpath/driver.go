package main

import (
	"context"
	"os"
	"sort"
	"strconv"
	"sync"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"
)

// defaultCapacity is used when a CreateVolume names no size (a PVC always does).
const defaultCapacity = 1 << 30

type driver struct {
	csi.UnimplementedIdentityServer
	csi.UnimplementedControllerServer
	csi.UnimplementedNodeServer

	name   string
	nodeID string

	// mu serialises every call that reads or changes the store. The sidecars retry a
	// call that timed out while the first attempt may still be copying data; holding
	// the lock across the copy makes the retry wait and then find the finished object
	// by name, instead of racing it.
	mu    sync.Mutex
	store *store

	// nodeMu serialises mounts and unmounts, so a retried publish finds the first
	// one's mount instead of stacking a second.
	nodeMu sync.Mutex
}

// --- Identity ---------------------------------------------------------------------

func (d *driver) GetPluginInfo(context.Context, *csi.GetPluginInfoRequest) (*csi.GetPluginInfoResponse, error) {
	return &csi.GetPluginInfoResponse{Name: d.name, VendorVersion: version}, nil
}

func (d *driver) GetPluginCapabilities(context.Context, *csi.GetPluginCapabilitiesRequest) (*csi.GetPluginCapabilitiesResponse, error) {
	// No VOLUME_ACCESSIBILITY_CONSTRAINTS: volumes live on this machine, which every
	// node of the local cluster (the real one and kwok's) is, so PVs carry no node
	// affinity and Pods may land anywhere.
	return &csi.GetPluginCapabilitiesResponse{Capabilities: []*csi.PluginCapability{{
		Type: &csi.PluginCapability_Service_{Service: &csi.PluginCapability_Service{
			Type: csi.PluginCapability_Service_CONTROLLER_SERVICE,
		}},
	}}}, nil
}

func (d *driver) Probe(context.Context, *csi.ProbeRequest) (*csi.ProbeResponse, error) {
	return &csi.ProbeResponse{}, nil // Ready unset means ready
}

// --- Controller -------------------------------------------------------------------

var controllerCaps = []csi.ControllerServiceCapability_RPC_Type{
	csi.ControllerServiceCapability_RPC_CREATE_DELETE_VOLUME,
	csi.ControllerServiceCapability_RPC_CREATE_DELETE_SNAPSHOT,
	csi.ControllerServiceCapability_RPC_LIST_SNAPSHOTS,
	csi.ControllerServiceCapability_RPC_CLONE_VOLUME,
}

func (d *driver) ControllerGetCapabilities(context.Context, *csi.ControllerGetCapabilitiesRequest) (*csi.ControllerGetCapabilitiesResponse, error) {
	resp := &csi.ControllerGetCapabilitiesResponse{}
	for _, c := range controllerCaps {
		resp.Capabilities = append(resp.Capabilities, &csi.ControllerServiceCapability{
			Type: &csi.ControllerServiceCapability_Rpc{Rpc: &csi.ControllerServiceCapability_RPC{Type: c}},
		})
	}
	return resp, nil
}

func (d *driver) CreateVolume(_ context.Context, req *csi.CreateVolumeRequest) (*csi.CreateVolumeResponse, error) {
	if req.GetName() == "" {
		return nil, status.Error(codes.InvalidArgument, "name is required")
	}
	if len(req.GetVolumeCapabilities()) == 0 {
		return nil, status.Error(codes.InvalidArgument, "volume_capabilities are required")
	}
	for _, c := range req.GetVolumeCapabilities() {
		if c.GetBlock() != nil {
			return nil, status.Error(codes.InvalidArgument, "block volumes are not supported: volumes are directories")
		}
	}
	required, limit := req.GetCapacityRange().GetRequiredBytes(), req.GetCapacityRange().GetLimitBytes()
	if limit > 0 && required > limit {
		return nil, status.Errorf(codes.OutOfRange, "required %d bytes exceeds limit %d", required, limit)
	}
	capacity := required
	if capacity == 0 {
		capacity = defaultCapacity
		if limit > 0 {
			capacity = min(capacity, limit)
		}
	}

	d.mu.Lock()
	defer d.mu.Unlock()
	s := d.store

	if v := s.volumeByName(req.GetName()); v != nil {
		if v.CapacityBytes < required || (limit > 0 && v.CapacityBytes > limit) {
			return nil, status.Errorf(codes.AlreadyExists, "volume %q exists with %d bytes, outside the requested range", v.Name, v.CapacityBytes)
		}
		return &csi.CreateVolumeResponse{Volume: d.csiVolume(v)}, nil
	}

	v := &volume{ID: newID("vol-"), Name: req.GetName(), CapacityBytes: capacity, Created: time.Now().UTC()}
	tmp := s.tempPath("volumes", v.ID)
	if err := os.Mkdir(tmp, 0o777); err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	defer os.RemoveAll(tmp) // no-op once renamed into place

	src := req.GetVolumeContentSource()
	switch {
	case src.GetSnapshot() != nil:
		sn, ok := s.snapshots[src.GetSnapshot().GetSnapshotId()]
		if !ok {
			return nil, status.Errorf(codes.NotFound, "snapshot %q not found", src.GetSnapshot().GetSnapshotId())
		}
		if sn.SizeBytes > capacity {
			return nil, status.Errorf(codes.OutOfRange, "snapshot %s needs %d bytes, volume has %d", sn.ID, sn.SizeBytes, capacity)
		}
		if err := restoreArchive(s.snapshotPath(sn.ID), tmp); err != nil {
			return nil, status.Errorf(codes.Internal, "restoring snapshot %s: %v", sn.ID, err)
		}
		v.SourceSnap = sn.ID
	case src.GetVolume() != nil:
		from, ok := s.volumes[src.GetVolume().GetVolumeId()]
		if !ok {
			return nil, status.Errorf(codes.NotFound, "volume %q not found", src.GetVolume().GetVolumeId())
		}
		if from.CapacityBytes > capacity {
			return nil, status.Errorf(codes.OutOfRange, "source volume %s has %d bytes, clone has %d", from.ID, from.CapacityBytes, capacity)
		}
		if err := copyDir(s.volumePath(from.ID), tmp); err != nil {
			return nil, status.Errorf(codes.Internal, "cloning volume %s: %v", from.ID, err)
		}
		v.SourceVolume = from.ID
	}
	// World-writable like an emptyDir: whoever runs the sandbox must be able to write.
	if err := os.Chmod(tmp, 0o777); err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	if err := os.Rename(tmp, s.volumePath(v.ID)); err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	if err := s.putVolume(v); err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	return &csi.CreateVolumeResponse{Volume: d.csiVolume(v)}, nil
}

func (d *driver) csiVolume(v *volume) *csi.Volume {
	out := &csi.Volume{
		VolumeId:      v.ID,
		CapacityBytes: v.CapacityBytes,
		// Lands in the PV's spec.csi.volumeAttributes: tests and tools find a volume's
		// files from the PV alone, wherever the state directory is.
		VolumeContext: map[string]string{"path": d.store.volumePath(v.ID)},
	}
	switch {
	case v.SourceSnap != "":
		out.ContentSource = &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{
			Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: v.SourceSnap}}}
	case v.SourceVolume != "":
		out.ContentSource = &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Volume{
			Volume: &csi.VolumeContentSource_VolumeSource{VolumeId: v.SourceVolume}}}
	}
	return out
}

func (d *driver) DeleteVolume(_ context.Context, req *csi.DeleteVolumeRequest) (*csi.DeleteVolumeResponse, error) {
	if req.GetVolumeId() == "" {
		return nil, status.Error(codes.InvalidArgument, "volume_id is required")
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	// Deleting an unknown volume succeeds: the caller may be retrying a delete that
	// finished. Snapshots are self-contained archives and outlive their source volume.
	if err := d.store.deleteVolume(req.GetVolumeId()); err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	return &csi.DeleteVolumeResponse{}, nil
}

func (d *driver) ValidateVolumeCapabilities(_ context.Context, req *csi.ValidateVolumeCapabilitiesRequest) (*csi.ValidateVolumeCapabilitiesResponse, error) {
	d.mu.Lock()
	_, ok := d.store.volumes[req.GetVolumeId()]
	d.mu.Unlock()
	if !ok {
		return nil, status.Errorf(codes.NotFound, "volume %q not found", req.GetVolumeId())
	}
	for _, c := range req.GetVolumeCapabilities() {
		if c.GetBlock() != nil {
			return &csi.ValidateVolumeCapabilitiesResponse{Message: "block access is not supported"}, nil
		}
	}
	return &csi.ValidateVolumeCapabilitiesResponse{Confirmed: &csi.ValidateVolumeCapabilitiesResponse_Confirmed{
		VolumeCapabilities: req.GetVolumeCapabilities(),
	}}, nil
}

func (d *driver) CreateSnapshot(_ context.Context, req *csi.CreateSnapshotRequest) (*csi.CreateSnapshotResponse, error) {
	if req.GetName() == "" || req.GetSourceVolumeId() == "" {
		return nil, status.Error(codes.InvalidArgument, "name and source_volume_id are required")
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	s := d.store

	if sn := s.snapshotByName(req.GetName()); sn != nil {
		if sn.SourceVolumeID != req.GetSourceVolumeId() {
			return nil, status.Errorf(codes.AlreadyExists, "snapshot %q exists for volume %s", sn.Name, sn.SourceVolumeID)
		}
		return &csi.CreateSnapshotResponse{Snapshot: csiSnapshot(sn)}, nil
	}
	v, ok := s.volumes[req.GetSourceVolumeId()]
	if !ok {
		return nil, status.Errorf(codes.NotFound, "volume %q not found", req.GetSourceVolumeId())
	}
	sn := &snapshot{ID: newID("snap-"), Name: req.GetName(), SourceVolumeID: v.ID, SizeBytes: v.CapacityBytes, Created: time.Now().UTC()}
	size, err := archiveDir(s.volumePath(v.ID), s.tempPath("snapshots", sn.ID), s.snapshotPath(sn.ID))
	if err != nil {
		return nil, status.Errorf(codes.Internal, "archiving volume %s: %v", v.ID, err)
	}
	sn.ArchiveSize = size
	if err := s.putSnapshot(sn); err != nil {
		_ = os.Remove(s.snapshotPath(sn.ID))
		return nil, status.Error(codes.Internal, err.Error())
	}
	return &csi.CreateSnapshotResponse{Snapshot: csiSnapshot(sn)}, nil
}

func csiSnapshot(sn *snapshot) *csi.Snapshot {
	return &csi.Snapshot{
		SnapshotId:     sn.ID,
		SourceVolumeId: sn.SourceVolumeID,
		SizeBytes:      sn.SizeBytes,
		CreationTime:   timestamppb.New(sn.Created),
		ReadyToUse:     true, // the archive is complete before CreateSnapshot returns
	}
}

func (d *driver) DeleteSnapshot(_ context.Context, req *csi.DeleteSnapshotRequest) (*csi.DeleteSnapshotResponse, error) {
	if req.GetSnapshotId() == "" {
		return nil, status.Error(codes.InvalidArgument, "snapshot_id is required")
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.store.deleteSnapshot(req.GetSnapshotId()); err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	return &csi.DeleteSnapshotResponse{}, nil
}

// ListSnapshots filters by snapshot or source volume and pages by position in id
// order; the token is that position.
func (d *driver) ListSnapshots(_ context.Context, req *csi.ListSnapshotsRequest) (*csi.ListSnapshotsResponse, error) {
	d.mu.Lock()
	var matched []*snapshot
	for _, sn := range d.store.snapshots {
		if (req.GetSnapshotId() == "" || sn.ID == req.GetSnapshotId()) &&
			(req.GetSourceVolumeId() == "" || sn.SourceVolumeID == req.GetSourceVolumeId()) {
			matched = append(matched, sn)
		}
	}
	d.mu.Unlock()
	sort.Slice(matched, func(i, j int) bool { return matched[i].ID < matched[j].ID })

	start := 0
	if tok := req.GetStartingToken(); tok != "" {
		n, err := strconv.Atoi(tok)
		if err != nil || n < 0 || n > len(matched) {
			return nil, status.Errorf(codes.Aborted, "invalid starting_token %q", tok)
		}
		start = n
	}
	end := len(matched)
	if m := int(req.GetMaxEntries()); m > 0 && start+m < end {
		end = start + m
	}
	resp := &csi.ListSnapshotsResponse{}
	for _, sn := range matched[start:end] {
		resp.Entries = append(resp.Entries, &csi.ListSnapshotsResponse_Entry{Snapshot: csiSnapshot(sn)})
	}
	if end < len(matched) {
		resp.NextToken = strconv.Itoa(end)
	}
	return resp, nil
}
