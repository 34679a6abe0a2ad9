// Command pgx-connect connects with pgx as docs/operations.md says: `pgx-connect uri [VAR]`
// passes the Secret's `uri` (or VAR) to pgx.Connect; `pgx-connect env` passes "" and lets
// pgx read the Secret's PG* variables. Prints one line:
// `driver=pgx <version> user=<login> ssl=<on|off>`.
package main

import (
	"context"
	"fmt"
	"os"
	"runtime/debug"
	"time"

	"github.com/jackc/pgx/v5"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: pgx-connect uri [VAR] | env")
		os.Exit(2)
	}
	conninfo := ""
	if os.Args[1] == "uri" {
		variable := "uri"
		if len(os.Args) > 2 {
			variable = os.Args[2]
		}
		conninfo = os.Getenv(variable)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, conninfo)
	if err != nil {
		fmt.Fprintf(os.Stderr, "pgx: %v\n", err)
		os.Exit(1)
	}
	defer conn.Close(ctx)
	var user string
	var ssl bool
	err = conn.QueryRow(ctx, "SELECT current_user::text, ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()").Scan(&user, &ssl)
	if err != nil {
		fmt.Fprintf(os.Stderr, "pgx: %v\n", err)
		os.Exit(1)
	}
	version := "unknown"
	if info, ok := debug.ReadBuildInfo(); ok {
		for _, dep := range info.Deps {
			if dep.Path == "github.com/jackc/pgx/v5" {
				version = dep.Version
			}
		}
	}
	state := "off"
	if ssl {
		state = "on"
	}
	fmt.Printf("driver=pgx %s user=%s ssl=%s\n", version, user, state)
}
