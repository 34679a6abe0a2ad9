//go:build tools

// Package helm pins Helm 3, which e2e/validate-manifests and the chart tests run
// (`helm template charts/dbops`, `helm lint`) and the deployed suite installs the chart
// with. It is never compiled; `go build` names the main package directly (see
// ../install.d/helm-kubeconform.sh).
package helm

import (
	_ "helm.sh/helm/v3/cmd/helm"
)
