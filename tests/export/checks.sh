# Sourced by the export tests (export_test.sh, moe_export_test.sh), which set py (a python3 with
# numpy) and fail (0; set to 1 by a failed check).
close() {  # close A B LABEL: |A - B| <= 1e-4 |A|
  if "$py" -c "import sys; a, b = $1, $2; sys.exit(0 if abs(a - b) <= 1e-4 * abs(a) else 1)"; then
    echo "ok   $3: perplexity $1 vs $2"
  else
    echo "FAIL $3: perplexity $1 vs $2 (more than 1e-4 relative apart)"; fail=1
  fi
}
