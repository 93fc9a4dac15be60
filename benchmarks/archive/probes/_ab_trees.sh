# Sourced by the A/B probes: ab_trees OLD_COMMIT sets $tmp to a new temporary directory holding
# $tmp/oldpkg and $tmp/newpkg, each a `hetquant` package (the four source folders of OLD_COMMIT,
# or of this working tree, linked in) to put first on PYTHONPATH.
ab_trees() {
  repo=$(git rev-parse --show-toplevel)
  tmp=$(mktemp -d)
  mkdir -p "$tmp/old/tree" "$tmp/oldpkg/hetquant" "$tmp/newpkg/hetquant"
  git -C "$repo" archive "$1" | tar -x -C "$tmp/old/tree"
  for d in formats convert calib runtime; do
    ln -sfn "$tmp/old/tree/$d" "$tmp/oldpkg/hetquant/$d"; ln -sfn "$repo/$d" "$tmp/newpkg/hetquant/$d"
  done
}
