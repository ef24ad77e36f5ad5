#!/usr/bin/env bash
# Makes, from Debian's and PyPI's package registries only, the inputs that docker/'s images need
# where Docker Hub cannot be reached and `docker build` has no registry access:
#
#   PYTHON_IMAGE      mori-python:3.11-bookworm-<hash>   Debian bookworm (debootstrap minbase) with
#                     python3 3.11 (+ venv, pip) and curl: stands in for python:3.11-slim
#   WHEELS_IMAGE      mori-wheels:<hash>                 /wheels: `pip wheel` of this project's
#                     dependencies and its build backend (FROM scratch, no other files)
#   PROMETHEUS_IMAGE  mori-prometheus:<version>-<hash>   Debian's prometheus binary, laid out
#                     like prom/prometheus (docker/local/Dockerfile.prometheus)
#   SGLANG_IMAGE      mori-sglang-standin:0.5.17-<hash>  PYTHON_IMAGE plus the sglang 0.5.17 wheel
#                     (no torch, no CUDA): stands in for lmsysorg/sglang so that
#                     docker/Dockerfile.sglang builds here (docker/local/Dockerfile.sglang-standin)
#
# and writes those four lines to $CACHE/images.env, for compose:
#
#   eval "$(scripts/local_dockerd.sh start)"     # an engine, if none is running
#   scripts/local_images.sh                      # prints the env file's path
#   set -a; . ~/.cache/mori/docker/images.env; set +a
#   docker-compose -f docker/compose.demo.yaml up -d --build replica-0 replica-1 router prometheus
#
# Idempotent and cached: every input is downloaded once into CACHE (MORI_DOCKER_CACHE, default
# ~/.cache/mori/docker: the bookworm root file system as a tarball, the wheelhouse, the .debs);
# an image is made only when its tag is missing from the engine; tags carry a hash of their
# inputs, so a change (pyproject.toml's dependencies, this script's package lists) makes new ones.
# A run with everything cached takes about a second. Needs root (debootstrap), an engine
# (DOCKER_HOST), and installs debootstrap with apt-get when it is missing.
set -euo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
CACHE="${MORI_DOCKER_CACHE:-$HOME/.cache/mori/docker}"
SUITE=bookworm
# python3-venv: the router image's build makes a venv; python3-pip + curl: what the SGLang image
# offers (a system pip, curl for the healthcheck), so the stand-in shows what the real build meets.
PACKAGES=python3,python3-venv,python3-pip,curl,ca-certificates
SGLANG_VERSION=0.5.17
mkdir -p "$CACHE"

log() { echo "local_images: $*" >&2; }
# Drop expected noise from stderr: pip on empty local index mirrors, apt-get download as root,
# and the docker CLI's notice that its legacy builder (the one compose 1.29 uses too) is deprecated.
NOISE='is ignored: it is neither a file nor a directory|legacy builder is deprecated|buildx|^$|unsandboxed'
quiet() { "$@" 2> >(grep -Ev "$NOISE" >&2); }
have_image() { docker image inspect "$1" >/dev/null 2>&1; }
short_hash() { sha1sum | cut -c1-10; }

python_image() {
  local tag tarball root
  # The hash names the recipe: a change to it (packages, the root's mode) makes a new image.
  tag="mori-python:3.11-$SUITE-$(echo "$SUITE $PACKAGES root=0755" | short_hash)"
  tarball="$CACHE/rootfs-${tag#*:}.tar"
  if ! have_image "$tag"; then
    if [[ ! -f "$tarball" ]]; then
      command -v debootstrap >/dev/null || (apt-get update -qq && apt-get install -y -qq debootstrap) >&2
      root="$(mktemp -d "$CACHE/rootfs.XXXXXX")"
      # mktemp's 0700 would become the image's `/`: non-root users (the router's `mori`,
      # Prometheus's `nobody`) could then run nothing. overlay2 happens to hide it; vfs does not.
      chmod 755 "$root"
      log "debootstrap $SUITE (minbase + $PACKAGES): a few minutes, once"
      # The mirror: debootstrap's default, or MORI_DEBIAN_MIRROR.
      debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$root" \
        ${MORI_DEBIAN_MIRROR:+"$MORI_DEBIAN_MIRROR"} >"$CACHE/debootstrap.log" 2>&1 \
        || { tail -n 20 "$CACHE/debootstrap.log" >&2; rm -rf "$root"; exit 1; }
      # What an image needs no copy of: downloaded .debs, package lists, docs.
      rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* \
        "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/info/*
      tar -C "$root" --numeric-owner -cf "$tarball.part" . && mv "$tarball.part" "$tarball"
      rm -rf "$root"
    fi
    log "importing $tag"
    docker import --change 'ENV LANG=C.UTF-8' \
      --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
      --change 'CMD ["python3"]' "$tarball" "$tag" >/dev/null
  fi
  echo "$tag"
}

wheels_image() {
  local hash dir tag
  hash="$(short_hash <"$REPO/pyproject.toml")"
  dir="$CACHE/wheels-$hash"
  tag="mori-wheels:$hash"
  if ! have_image "$tag"; then
    if [[ ! -d "$dir" ]]; then
      log "pip wheel: the project's dependencies into $dir"
      # The project's own wheel is built too (pip wheel cannot skip it) and then dropped: the
      # images install the project from source, with the build backend from this wheelhouse.
      quiet python3 -m pip wheel -q --wheel-dir "$dir.part" "$REPO" "setuptools>=68" wheel >&2
      rm -f "$dir.part"/mori-*.whl
      mv "$dir.part" "$dir"
    fi
    log "building $tag"
    printf 'FROM scratch\nCOPY . /wheels/\n' | quiet docker build -q -t "$tag" -f - "$dir" >/dev/null
  fi
  echo "$tag"
}

prometheus_image() {
  local base="$1" deb version dir tag
  dir="$CACHE/prometheus"
  mkdir -p "$dir"
  # The .deb of the Debian release this machine's apt sources name, downloaded once.
  deb="$(compgen -G "$dir/prometheus_*.deb" | tail -n 1 || true)"
  if [[ -z "$deb" ]]; then
    (cd "$dir" && quiet apt-get download -q prometheus >&2)
    deb="$(compgen -G "$dir/prometheus_*.deb" | tail -n 1)"
  fi
  version="$(dpkg-deb -f "$deb" Version)"
  tag="mori-prometheus:${version//[^A-Za-z0-9_.-]/-}-${base##*-}"
  if ! have_image "$tag"; then
    rm -rf "$dir/context" && mkdir -p "$dir/context"
    dpkg-deb --fsys-tarfile "$deb" | tar -x -C "$dir/context" --strip-components=3 ./usr/bin/prometheus
    log "building $tag"
    quiet docker build -q -t "$tag" --build-arg BASE_IMAGE="$base" \
      -f "$REPO/docker/local/Dockerfile.prometheus" "$dir/context" >/dev/null
  fi
  echo "$tag"
}

sglang_standin_image() {
  local base="$1" dir tag
  dir="$CACHE/sglang-$SGLANG_VERSION"
  tag="mori-sglang-standin:$SGLANG_VERSION-${base##*-}"
  if ! have_image "$tag"; then
    if ! compgen -G "$dir/sglang-*.whl" >/dev/null; then
      log "pip download sglang==$SGLANG_VERSION (the wheel alone, no dependencies)"
      quiet python3 -m pip download -q --no-deps --only-binary=:all: -d "$dir" "sglang==$SGLANG_VERSION" >&2
    fi
    log "building $tag"
    quiet docker build -q -t "$tag" --build-arg BASE_IMAGE="$base" \
      -f "$REPO/docker/local/Dockerfile.sglang-standin" "$dir" >/dev/null
  fi
  echo "$tag"
}

# Older versions of the same images and their cached inputs: removed, so the cache stays one
# set deep (a re-run after a change rebuilds from what it still needs).
prune_stale() {
  local keep=" $* " image path name
  for image in $(docker image ls --format '{{.Repository}}:{{.Tag}}'); do
    [[ "$image" =~ ^mori-(python|wheels|prometheus|sglang-standin): ]] || continue
    [[ "$keep" == *" $image "* ]] || docker rmi "$image" >/dev/null
  done
  for path in "$CACHE"/rootfs-*.tar "$CACHE"/wheels-*; do
    [[ -e "$path" ]] || continue
    name="${path##*/}"
    name="${name%.tar}" # rootfs-3.11-bookworm-<hash> or wheels-<hash>: the tag after the dash
    [[ "$keep" == *"${name#*-}"* ]] || rm -rf "$path"
  done
}

docker version --format '{{.Server.Version}}' >/dev/null \
  || { log "no Docker engine answers: eval \"\$(scripts/local_dockerd.sh start)\""; exit 1; }
PYTHON_IMAGE="$(python_image)"
WHEELS_IMAGE="$(wheels_image)"
PROMETHEUS_IMAGE="$(prometheus_image "$PYTHON_IMAGE")"
SGLANG_IMAGE="$(sglang_standin_image "$PYTHON_IMAGE")"
prune_stale "$PYTHON_IMAGE" "$WHEELS_IMAGE" "$PROMETHEUS_IMAGE" "$SGLANG_IMAGE"
cat >"$CACHE/images.env" <<EOF
PYTHON_IMAGE=$PYTHON_IMAGE
WHEELS_IMAGE=$WHEELS_IMAGE
PROMETHEUS_IMAGE=$PROMETHEUS_IMAGE
SGLANG_IMAGE=$SGLANG_IMAGE
EOF
echo "$CACHE/images.env"
