#!/usr/bin/env bash
# Headless Chromium for the HTML report's tests (tests/conftest.py, chromium()), from Debian's
# packages, without those it only recommends (the tests read the DOM it renders: 18 packages
# against 94). Needs root and apt-get: exits 77 where either is missing. .ci/run runs it beside the
# set-up, so that no test waits on it; the tests run it where Chromium is missing. Another apt-get
# running (slurm/local/slurm-up.sh's) is waited for.
set -euo pipefail
command -v chromium > /dev/null && exit 0
[[ $(id -u) == 0 ]] && command -v apt-get > /dev/null || { echo "install-chromium: needs root and apt-get"; exit 77; }
export DEBIAN_FRONTEND=noninteractive
install=(apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends chromium)
"${install[@]}" > /dev/null 2>&1 || { apt-get update -qq && "${install[@]}" > /dev/null; }
command -v chromium
