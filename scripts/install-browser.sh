#!/usr/bin/env bash
# Debian's Chromium and its WebDriver for the browser tests (tests/browser, `nox -s browser`), and a
# font so that screenshots show text. Idempotent: installs only what is missing. Needs root (apt-get).
set -euo pipefail
packages=(chromium chromium-driver fonts-dejavu-core)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
for command in chromium chromedriver; do
  command -v "$command" >/dev/null || { echo "$command is not on PATH after installing ${packages[*]}" >&2; exit 1; }
done
