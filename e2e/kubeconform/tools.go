//go:build tools

// Package kubeconform pins kubeconform, which e2e/validate-manifests runs
// (`kubeconform -strict`) on deploy/ and on charts/dbops, against JSON schemas generated
// here from the Kubernetes API's OpenAPI document and from our CRDs (e2e has no network
// to the schemas' usual home on GitHub). It is never compiled; `go build` names the main
// package directly (see ../install.d/helm-kubeconform.sh).
package kubeconform

import (
	_ "github.com/yannh/kubeconform/cmd/kubeconform"
)
