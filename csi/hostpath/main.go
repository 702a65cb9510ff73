// Command csi-hostpath is Savepoint's small CSI driver for the local control plane.
//
// Volumes are plain directories on this machine and snapshots are tar.gz archives of
// them, so a VolumeSnapshot really copies a workspace's files and a restore really
// brings them back. It exists because the upstream csi-driver-host-path module is not
// served by the Go module proxy we build from; see docs/csi.md.
//
// It serves the Identity, Controller and Node services on one unix socket: the
// external-provisioner and csi-snapshotter sidecars call the first two, and the real
// node's kubelet calls the Node service to bind-mount a volume's directory into a Pod.
// With --kubelet-registration-dir it also serves the kubelet's plugin registration API
// on a second socket in that folder, which is how the kubelet finds the driver (the
// job node-driver-registrar does elsewhere). Pods on kwok's fake nodes are never
// mounted; tests that use them read and write the volume directories directly.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
)

// version is set at build time (hack/build-binaries passes a hash of these sources).
var version = "dev"

func main() {
	endpoint := flag.String("endpoint", "unix:///tmp/csi-hostpath.sock", "CSI endpoint, unix://<path>")
	nodeID := flag.String("nodeid", "", "node id reported by NodeGetInfo (required)")
	stateDir := flag.String("statedir", "", "directory holding volumes/, snapshots/ and meta/ (required)")
	driverName := flag.String("drivername", "hostpath.csi.savepoint.dev", "CSI driver name")
	healthAddr := flag.String("health-address", "", "host:port serving GET /healthz once the socket listens (off when empty)")
	registrationDir := flag.String("kubelet-registration-dir", "",
		"the kubelet's <root-dir>/plugins_registry: serve plugin registration on <dir>/<drivername>-reg.sock (off when empty)")
	flag.Parse()
	if *nodeID == "" || *stateDir == "" {
		log.Fatal("--nodeid and --statedir are required")
	}

	store, err := openStore(*stateDir)
	if err != nil {
		log.Fatalf("opening state directory: %v", err)
	}
	drv := &driver{name: *driverName, nodeID: *nodeID, store: store}

	csiSocket, err := socketPath(*endpoint)
	if err == nil {
		csiSocket, err = filepath.Abs(csiSocket) // the kubelet dials it from its own folder
	}
	if err != nil {
		log.Fatal(err)
	}
	lis, err := listenUnix(*endpoint)
	if err != nil {
		log.Fatal(err)
	}
	srv := grpc.NewServer(grpc.UnaryInterceptor(logCalls))
	csi.RegisterIdentityServer(srv, drv)
	csi.RegisterControllerServer(srv, drv)
	csi.RegisterNodeServer(srv, drv)

	// The registration socket comes after the CSI socket listens: the kubelet dials the
	// CSI endpoint as soon as GetInfo has named it.
	var regSrv *grpc.Server
	if *registrationDir != "" {
		var regSocket string
		regSrv, regSocket, err = serveRegistration(*registrationDir, *driverName, csiSocket)
		if err != nil {
			log.Fatal(err)
		}
		log.Printf("kubelet plugin registration on %s", regSocket)
	}

	if *healthAddr != "" {
		go serveHealth(*healthAddr)
	}

	// Stop cleanly on SIGTERM so an in-flight archive finishes and the sockets are
	// removed (closing a listener unlinks its socket); the registration socket goes
	// first, so the kubelet deregisters the driver before its endpoint disappears.
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT)
	go func() {
		<-sigs
		log.Print("stopping")
		if regSrv != nil {
			regSrv.GracefulStop()
		}
		srv.GracefulStop()
	}()

	log.Printf("%s %s serving on %s, state in %s", *driverName, version, *endpoint, *stateDir)
	if err := srv.Serve(lis); err != nil {
		log.Fatal(err)
	}
}

// maxSocketPath is the longest unix socket path Linux accepts (sun_path less its NUL).
const maxSocketPath = 107

// socketPath accepts unix:///abs/path and unix:/abs/path and returns the path.
func socketPath(endpoint string) (string, error) {
	path, ok := strings.CutPrefix(endpoint, "unix://")
	if !ok {
		path, ok = strings.CutPrefix(endpoint, "unix:")
	}
	if !ok || path == "" {
		return "", fmt.Errorf("endpoint %q: only unix://<path> is supported", endpoint)
	}
	if len(path) > maxSocketPath {
		return "", fmt.Errorf("socket path %s is %d bytes, longer than the %d a unix socket allows: use a shorter folder", path, len(path), maxSocketPath)
	}
	return path, nil
}

// listenUnix listens on a unix:// endpoint, removing a socket left behind by a
// previous run (it would otherwise fail with "address already in use").
func listenUnix(endpoint string) (net.Listener, error) {
	path, err := socketPath(endpoint)
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return nil, err
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("removing stale socket %s: %w", path, err)
	}
	return net.Listen("unix", path)
}

func serveHealth(addr string) {
	mux := http.NewServeMux()
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) {
		_, _ = w.Write([]byte("ok\n"))
	})
	log.Fatal(http.ListenAndServe(addr, mux))
}

// logCalls logs every RPC with its duration and error: the driver's log is the first
// place to look when a PVC stays Pending or a VolumeSnapshot never becomes ready, and
// the durations split a slow snapshot or restore into driver time and the rest.
func logCalls(ctx context.Context, req any, info *grpc.UnaryServerInfo, next grpc.UnaryHandler) (any, error) {
	start := time.Now()
	resp, err := next(ctx, req)
	took := time.Since(start).Round(time.Millisecond)
	method := info.FullMethod[strings.LastIndex(info.FullMethod, "/")+1:]
	switch {
	case err != nil:
		log.Printf("%s: error after %s: %v", method, took, err)
	case method != "Probe": // the sidecars probe often; keep the log readable
		log.Printf("%s: ok in %s", method, took)
	}
	return resp, err
}
