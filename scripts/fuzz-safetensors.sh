#!/usr/bin/env bash
# Fuzzes the safetensors parser for SECONDS (default 60): scripts/fuzz.sh with one target.
#   scripts/fuzz-safetensors.sh [SECONDS]
exec bash "$(dirname "$0")/fuzz.sh" "${1:-60}" safetensors_fuzz
