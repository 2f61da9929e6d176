#!/bin/sh
# Install the Debian packages named as arguments when any is missing.
# Quick when all are present (one dpkg-query); says clearly why it cannot install otherwise.
set -eu
[ "$#" -gt 0 ] || exit 0
missing=""
for pkg in "$@"; do
  if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
    missing="$missing $pkg"
  fi
done
[ -n "$missing" ] || exit 0
echo "system packages missing:$missing"
if ! command -v apt-get >/dev/null 2>&1; then
  echo "error: apt-get is not available; install these packages with your system's package manager:$missing" >&2
  exit 1
fi
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO="sudo -n"
  else
    echo "error: installing$missing needs root; run: sudo apt-get install -y$missing" >&2
    exit 1
  fi
else
  SUDO=""
fi
export DEBIAN_FRONTEND=noninteractive
# An old or empty package list finds nothing: refresh it once before installing.
$SUDO apt-get update -qq
# shellcheck disable=SC2086
$SUDO apt-get install -y -qq $missing >/dev/null
echo "installed:$missing"
