//go:build tools

// Package glua pins gopher-lua, the Lua 5.1 interpreter Argo CD embeds to run resource
// health checks, whose command-line `glua` runs deploy/argocd's health checks against
// statuses recorded from real objects (e2e/tests/e2e/argocd_health.rs). It is never
// compiled; `go build` names the main package directly (see
// ../install.d/helm-kubeconform.sh).
package glua

import (
	_ "github.com/yuin/gopher-lua/cmd/glua"
)
