//go:build tools

// Package jaeger pins the Jaeger v2 binary that the dbops dev environment and the
// tracing tests start. It is never compiled; `go build` names the main package
// directly (see ../install).
package jaeger

import (
	_ "github.com/jaegertracing/jaeger/cmd/jaeger"
)
