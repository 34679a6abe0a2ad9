module dbops.dev/e2e/glua

go 1.24.0

require github.com/yuin/gopher-lua v1.1.2

require (
	github.com/chzyer/readline v0.0.0-20180603132655-2972be24d48e // indirect
	golang.org/x/sys v0.0.0-20190204203706-41f3e6584952 // indirect
)
