// Command etcd is the etcd server that kube-apiserver stores its state in, built from
// go.etcd.io/etcd/server/v3 at the version that k8s.io/kubernetes itself requires.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
