//go:build tools

// Package coredns pins CoreDNS, the cluster DNS that e2e/cluster runs as a process on
// the node's address (kubelet's clusterDNS). It is never compiled; e2e/install builds
// the main package github.com/coredns/coredns directly.
package coredns

import (
	_ "github.com/coredns/coredns"
)
