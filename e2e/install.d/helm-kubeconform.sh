# shellcheck shell=bash
# Sourced by e2e/install (which sets $here, $cache and log()): helm and kubeconform, built
# from the Go modules pinned in e2e/helm/go.mod and e2e/kubeconform/go.mod, into
#   $cache/helm-<version>/helm
#   $cache/kubeconform-<version>/kubeconform
# like the Jaeger and promtool blocks: a build only when that directory lacks the binary.
# helm renders and installs charts/dbops; kubeconform validates deploy/ and the chart
# (e2e/validate-manifests), against JSON schemas that e2e/validate-manifests generates
# locally (`dbops-kubeconform-schemas`, into $cache/kubeconform-schemas-<k8s version>/):
# GitHub, their usual home, is out of reach here.

dbops_go_tool() { # <name> <dir under e2e/> <module> <main package>
  local name=$1 dir=$2 module=$3 pkg=$4 version out tmp start ldflags
  version=$(awk -v m="$module" '$1=="require" && $2==m {print $3; exit} $1==m {print $2; exit}' \
    "$here/$dir/go.mod")
  out="$cache/$name-$version"
  [ -x "$out/$name" ] && return 0
  command -v go >/dev/null 2>&1 || { log "go is required to build $name"; exit 1; }
  log "building $name $version into $out (first time only)"
  start=$(date +%s)
  tmp="$out.partial.$$"
  rm -rf "$tmp"; mkdir -p "$tmp"
  trap 'rm -rf "$tmp"' EXIT
  ldflags="-s -w"
  case $name in
    # `helm version` reports the pinned release, not v3.x-dev.
    helm) ldflags+=" -X helm.sh/helm/v3/internal/version.version=$version" ;;
    kubeconform) ldflags+=" -X main.version=$version" ;;
  esac
  (
    cd "$here/$dir"
    export CGO_ENABLED=0 GOFLAGS="-mod=readonly -buildvcs=false"
    go build -trimpath -ldflags "$ldflags" -o "$tmp/$name" "$pkg"
  ) >&2
  rm -rf "$out"; mv "$tmp" "$out"; trap - EXIT
  log "built $name in $(( $(date +%s) - start ))s"
}

# helm: 84 s here with its modules downloaded (~2 min cold with the downloads).
dbops_go_tool helm helm helm.sh/helm/v3 helm.sh/helm/v3/cmd/helm
# kubeconform: a few seconds (~20 s cold with the downloads).
dbops_go_tool kubeconform kubeconform github.com/yannh/kubeconform \
  github.com/yannh/kubeconform/cmd/kubeconform
# glua: gopher-lua's interpreter, the Lua Argo CD embeds, for deploy/argocd's health
# checks (e2e/tests/e2e/argocd_health.rs); a few seconds.
dbops_go_tool glua glua github.com/yuin/gopher-lua github.com/yuin/gopher-lua/cmd/glua
