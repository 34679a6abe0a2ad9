//go:build tools

// Package promtool pins Prometheus's promtool, which `e2e/test` runs to unit-test the
// alert rules of deploy/components/prometheus-rules (`promtool test rules`). It is never
// compiled; `go build` names the main package directly (see ../install).
package promtool

import (
	_ "github.com/prometheus/prometheus/cmd/promtool"
)
