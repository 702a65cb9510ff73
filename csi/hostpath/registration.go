package main

import (
	"context"
	"fmt"
	"log"
	"path/filepath"

	"google.golang.org/grpc"
	registration "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
)

// The kubelet finds node plugins by watching its plugins_registry folder (and walking
// it at start): for each socket there it calls GetInfo, checks the answer, registers
// the plugin and reports the outcome with NotifyRegistrationStatus. A CSI plugin's
// answer names the socket of its CSI endpoint, which the kubelet then dials for
// NodeGetInfo and NodePublishVolume. Clusters usually run node-driver-registrar for
// this; the driver serves the same small API itself.

// registrationSocket is where the driver listens in the kubelet's plugins_registry.
func registrationSocket(dir, driverName string) string {
	return filepath.Join(dir, driverName+"-reg.sock")
}

type registrar struct {
	registration.UnimplementedRegistrationServer

	driverName string
	// csiSocket is the plain path of the CSI endpoint (no unix:// prefix): the kubelet
	// dials it as a unix socket address.
	csiSocket string
}

// supportedVersions are the CSI spec versions offered to the kubelet.
var supportedVersions = []string{"1.0.0"}

func (r *registrar) GetInfo(context.Context, *registration.InfoRequest) (*registration.PluginInfo, error) {
	return &registration.PluginInfo{
		Type:              registration.CSIPlugin,
		Name:              r.driverName,
		Endpoint:          r.csiSocket,
		SupportedVersions: supportedVersions,
	}, nil
}

func (r *registrar) NotifyRegistrationStatus(_ context.Context, st *registration.RegistrationStatus) (*registration.RegistrationStatusResponse, error) {
	if st.GetPluginRegistered() {
		log.Printf("registered with the kubelet as %s (CSI endpoint %s)", r.driverName, r.csiSocket)
	} else {
		log.Printf("ERROR: the kubelet refused to register %s: %s", r.driverName, st.GetError())
	}
	return &registration.RegistrationStatusResponse{}, nil
}

// serveRegistration listens on the registration socket in dir and serves the kubelet's
// plugin registration API there until the returned server is stopped. Stopping it
// closes the listener, which removes the socket, and that deregisters the plugin.
func serveRegistration(dir, driverName, csiSocket string) (*grpc.Server, string, error) {
	path := registrationSocket(dir, driverName)
	lis, err := listenUnix("unix://" + path)
	if err != nil {
		return nil, "", fmt.Errorf("kubelet registration socket: %w", err)
	}
	srv := grpc.NewServer(grpc.UnaryInterceptor(logCalls))
	registration.RegisterRegistrationServer(srv, &registrar{driverName: driverName, csiSocket: csiSocket})
	go func() {
		if err := srv.Serve(lis); err != nil {
			log.Printf("registration server: %v", err)
		}
	}()
	return srv, path, nil
}
