package main

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	registration "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
)

// TestRegistrationAnswersTheKubelet dials the registration socket as the kubelet's
// plugin watcher does and checks what the driver says about itself.
func TestRegistrationAnswersTheKubelet(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "plugins_registry") // made by the driver if missing
	srv, path, err := serveRegistration(dir, "hostpath.csi.savepoint.dev", "/run/x/csi.sock")
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Stop()
	if want := filepath.Join(dir, "hostpath.csi.savepoint.dev-reg.sock"); path != want {
		t.Fatalf("registration socket %s, want %s", path, want)
	}

	conn, err := grpc.NewClient("unix://"+path, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	client := registration.NewRegistrationClient(conn)
	ctx := context.Background()
	info, err := client.GetInfo(ctx, &registration.InfoRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if info.Type != registration.CSIPlugin || info.Name != "hostpath.csi.savepoint.dev" ||
		info.Endpoint != "/run/x/csi.sock" || !slices.Equal(info.SupportedVersions, []string{"1.0.0"}) {
		t.Fatalf("GetInfo = %+v", info)
	}
	for _, st := range []*registration.RegistrationStatus{{PluginRegistered: true}, {Error: "version not supported"}} {
		if _, err := client.NotifyRegistrationStatus(ctx, st); err != nil {
			t.Fatalf("NotifyRegistrationStatus(%+v): %v", st, err)
		}
	}

	// Stopping removes the socket, which is what tells the kubelet the plugin is gone.
	srv.GracefulStop()
	if _, err := os.Stat(path); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("registration socket still there after stop: %v", err)
	}
}

func TestSocketPathRefusesWhatUnixSocketsCannotHold(t *testing.T) {
	long := "/" + strings.Repeat("d", maxSocketPath)
	if _, err := socketPath("unix://" + long); err == nil || !strings.Contains(err.Error(), "longer than") {
		t.Fatalf("a %d-byte socket path: %v", len(long), err)
	}
	if _, err := socketPath("tcp://127.0.0.1:1"); err == nil {
		t.Fatal("a tcp endpoint was accepted")
	}
}
