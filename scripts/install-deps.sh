#!/usr/bin/env bash
# Installs every Debian package qcal needs to build, test and run. Idempotent: packages already
# present are skipped, and apt-get update runs at most once.
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build ccache pkg-config git clang
  libtorch-dev
  libopenmpi-dev openmpi-bin
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler grpc-proto
  libpcre2-dev nlohmann-json3-dev libyaml-cpp-dev libcli11-dev libspdlog-dev libfmt-dev libabsl-dev
  liblapack-dev libopenblas-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  python3-numpy
  slurmctld slurmd slurm-client munge  # the local test cluster (slurm/local-cluster.sh)
  chromium  # renders the job report in a test (tests/report/report_test.sh)
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#PACKAGES[@]} packages present"
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
echo "install-deps: installing ${missing[*]}"
$SUDO apt-get update -q
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
