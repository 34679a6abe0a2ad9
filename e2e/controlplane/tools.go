//go:build tools

// Package controlplane pins the Kubernetes control-plane programs that the dbops
// test bed builds from source. It is never compiled; `go build` names the main
// packages directly (see ../install).
package controlplane

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-proxy"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubelet"
)
