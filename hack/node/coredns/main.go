// CoreDNS with only the plugins the e2e node's Corefile uses (tests/e2e/node_config.py), so
// that it builds from the client-go packages kubelet already compiled instead of CoreDNS's
// whole plugin set (cloud DNS providers and all): hack/node/build.sh builds it.
package main

import (
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/kubernetes"
)

func main() {
	coremain.Run()
}
