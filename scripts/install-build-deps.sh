#!/usr/bin/env bash
# The Rust crates loom-supervisor builds from: Debian's librust-*-dev packages (crates.io is
# not reachable on these machines; .cargo/config.toml points cargo at Debian's registry).
# Idempotent: installs only what is missing. Needs root (apt-get) and cargo on PATH.
set -euo pipefail
packages=(
  librust-pyo3-dev librust-rmp-dev librust-rmp-serde-dev librust-serde-dev 'librust-serde+serde-derive-dev'
  librust-serde-bytes-dev librust-nix-dev librust-libc-dev librust-tokio-dev librust-thiserror-dev
  librust-clap-dev librust-clap-derive-dev librust-log-dev librust-env-logger-dev
  'librust-env-logger+default-dev' librust-tempfile-dev librust-proptest-dev 'librust-proptest+std-dev'
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "installing ${#missing[@]} Debian crate packages: ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
command -v cargo >/dev/null || { echo "cargo is not on PATH (rustup's ~/.cargo/bin?)" >&2; exit 1; }
