#!/usr/bin/env bash
# Carry NVIDIA DALI (and the wheels it needs that the device image lacks) to a lent GPU machine,
# which reaches no package registry and takes at most 64 MiB of working tree per call: the
# wheels travel as one tar cut into pieces, one piece per call, on one warm machine (docs/gpu.md
# "DALI on the device" gives the exact sequence of calls).
#
#   here:  bash tools/carry_wheel.sh pack      [DIR]   download (pip download, CPython 3.12,
#                                                      manylinux x86_64, no dependencies resolved:
#                                                      the list below) into DIR/wheels, tar them
#                                                      into DIR/bundle.tar, cut it into
#                                                      DIR/piece.NNN of at most
#                                                      NAC_FAST_PIECE_MIB (48) MiB, and write
#                                                      DIR/MANIFEST (sha256 of every piece and of
#                                                      the bundle; DIR/wheels and bundle.tar stay
#                                                      here only)
#   here:  bash tools/carry_wheel.sh cut       [DIR]   pack's tar, pieces and MANIFEST from the
#                                                      wheels already in DIR/wheels (no download)
#   there: bash tools/carry_wheel.sh receive   [DIR]   copy the pieces carried in DIR (with MANIFEST)
#                                                      to the persistent folder PIECES
#                                                      (/tmp/dali_pieces), each checked against
#                                                      MANIFEST
#   there: bash tools/carry_wheel.sh install   [DIR]   all pieces in PIECES checked, joined, the
#                                                      bundle's sum checked, the wheels installed
#                                                      with pip --target SITE (/tmp/dali_site);
#                                                      prints the PYTHONPATH line to export.  Done
#                                                      once per machine: a second install finds SITE
#                                                      ready and returns at once
#   either: bash tools/carry_wheel.sh check    [DIR]   like install's checks, no install (here:
#                                                      the pieces in DIR joined equal the bundle)
#
# DIR defaults to .dali_carry (ignored by git: never commit the wheels or the pieces).
# NAC_FAST_DALI_PIECES and NAC_FAST_DALI_SITE override PIECES and SITE; PYTHON (default python3)
# is the interpreter that installs (the device image's python3: 3.12, CUDA 13).
# Errors name what is wrong (a missing piece, a piece or bundle whose sha256 differs, a wheel pip
# refuses) and exit 1; bad usage exits 2.  Nothing is half-installed: pip installs into a new
# folder renamed to SITE only when it succeeded.
set -uo pipefail

# the wheels: DALI for CUDA 13 and what it needs that the device image (its package list, as the device tool gives it)
# lacks, at the versions tested here with tests/test_data_dali.py
WHEELS=(nvidia-dali-cuda130==2.4.0 nvidia-nvimgcodec-cu13==0.9.0.20 nvidia-libnvcomp-cu13==5.3.0.16
        nvidia-nvjpeg==13.3.2.43 nvidia-nvjpeg2k-cu13==0.11.0.51 libcst==1.9.0 optree==0.20.0
        makefun==1.16.0 nvtx==0.2.17 astunparse==1.6.3 gast==0.7.0)
PIECES=${NAC_FAST_DALI_PIECES:-/tmp/dali_pieces}
SITE=${NAC_FAST_DALI_SITE:-/tmp/dali_site}
PY=${PYTHON:-python3}

die() { echo "carry_wheel.sh: $*" >&2; exit 1; }
usage() { sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//' >&2; exit "${1:-2}"; }

# sum_of FILE: its sha256
sum_of() { sha256sum "$1" | cut -d' ' -f1; }

# manifest_pieces DIR: the piece names MANIFEST lists, in order
manifest_pieces() { awk '$2 ~ /^piece\.[0-9]+$/ {print $2}' "$1/MANIFEST"; }

# check_pieces MANIFEST_DIR PIECE_DIR: every listed piece present with its sum; prints the
# bundle's sum.  A missing or corrupt piece is named.
check_pieces() {
  local mdir=$1 pdir=$2 p want got n=0
  [ -f "$mdir/MANIFEST" ] || die "no MANIFEST in $mdir (bash tools/carry_wheel.sh pack makes it)"
  while read -r p; do
    n=$((n + 1))
    want=$(awk -v p="$p" '$2 == p {print $1}' "$mdir/MANIFEST")
    [ -f "$pdir/$p" ] || die "missing piece $p in $pdir ($(manifest_pieces "$mdir" | wc -l) listed in MANIFEST): carry it"
    got=$(sum_of "$pdir/$p")
    [ "$got" = "$want" ] || die "corrupt piece $pdir/$p: sha256 $got, MANIFEST says $want"
  done < <(manifest_pieces "$mdir")
  [ "$n" -gt 0 ] || die "MANIFEST in $mdir lists no piece"
  awk '$2 == "bundle.tar" {print $1}' "$mdir/MANIFEST"
}

# join MANIFEST_DIR PIECE_DIR OUT: the checked pieces joined into OUT, the bundle's sum checked
join_pieces() {
  local mdir=$1 pdir=$2 out=$3 want got p
  want=$(check_pieces "$mdir" "$pdir") || exit 1
  [ -n "$want" ] || die "MANIFEST in $mdir has no bundle.tar line"
  : > "$out.part"
  while read -r p; do cat "$pdir/$p" >> "$out.part" || die "could not write $out.part"; done \
    < <(manifest_pieces "$mdir")
  got=$(sum_of "$out.part")
  [ "$got" = "$want" ] || { rm -f "$out.part"; die "joined bundle's sha256 $got differs from MANIFEST's $want (pieces out of order or from another pack)"; }
  mv "$out.part" "$out"
}

cmd=${1:-}
DIR=${2:-.dali_carry}
[ $# -le 2 ] || usage
case "$cmd" in
  pack)
    piece_mib=${NAC_FAST_PIECE_MIB:-48}
    [[ "$piece_mib" =~ ^[0-9]+$ ]] && [ "$piece_mib" -ge 1 ] && [ "$piece_mib" -le 60 ] || {
      echo "carry_wheel.sh: NAC_FAST_PIECE_MIB must be 1..60 (the repo travels too: 64 MiB a call), got '$piece_mib'" >&2; exit 2; }
    mkdir -p "$DIR/wheels" || die "cannot make $DIR/wheels"
    "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux1_x86_64 --platform any -d "$DIR/wheels" "${WHEELS[@]}" \
      || die "pip download failed (the wheel list is at the top of tools/carry_wheel.sh)"
    ;;&
  pack|cut)
    piece_mib=${NAC_FAST_PIECE_MIB:-48}
    [[ "$piece_mib" =~ ^[0-9]+$ ]] && [ "$piece_mib" -ge 1 ] && [ "$piece_mib" -le 60 ] || {
      echo "carry_wheel.sh: NAC_FAST_PIECE_MIB must be 1..60 (the repo travels too: 64 MiB a call), got '$piece_mib'" >&2; exit 2; }
    rm -f "$DIR"/piece.* "$DIR/MANIFEST" "$DIR/bundle.tar"
    (cd "$DIR/wheels" && ls *.whl > /dev/null) || die "no wheels in $DIR/wheels"
    tar -cf "$DIR/bundle.tar.part" -C "$DIR" wheels && mv "$DIR/bundle.tar.part" "$DIR/bundle.tar" \
      || die "could not write $DIR/bundle.tar"
    split -b "${piece_mib}M" -d -a 3 "$DIR/bundle.tar" "$DIR/piece." || die "split failed"
    { (cd "$DIR" && sha256sum piece.*); echo "$(sum_of "$DIR/bundle.tar")  bundle.tar"; } \
      > "$DIR/MANIFEST.part" && mv "$DIR/MANIFEST.part" "$DIR/MANIFEST"
    check_pieces "$DIR" "$DIR" > /dev/null
    n=$(manifest_pieces "$DIR" | wc -l)
    echo "packed $(ls "$DIR/wheels" | wc -l) wheels, $(stat -c %s "$DIR/bundle.tar") bytes, into $n pieces of at most $piece_mib MiB: $DIR/piece.000 .. $(manifest_pieces "$DIR" | tail -1)"
    ;;
  receive)
    [ -f "$DIR/MANIFEST" ] || die "no MANIFEST in $DIR: carry $DIR/MANIFEST with each piece"
    mkdir -p "$PIECES" || die "cannot make $PIECES"
    if [ -f "$PIECES/MANIFEST" ] && ! cmp -s "$DIR/MANIFEST" "$PIECES/MANIFEST"; then
      die "$PIECES holds pieces of another pack (its MANIFEST differs): remove $PIECES first"
    fi
    cp "$DIR/MANIFEST" "$PIECES/MANIFEST"
    got=0
    for f in "$DIR"/piece.*; do
      [ -f "$f" ] || continue
      p=$(basename "$f")
      want=$(awk -v p="$p" '$2 == p {print $1}' "$DIR/MANIFEST")
      [ -n "$want" ] || die "$f is not listed in $DIR/MANIFEST"
      [ "$(sum_of "$f")" = "$want" ] || die "corrupt piece $f: its sha256 differs from MANIFEST's"
      cp "$f" "$PIECES/$p.part" && mv "$PIECES/$p.part" "$PIECES/$p" || die "could not copy $f to $PIECES"
      got=$((got + 1))
    done
    [ "$got" -gt 0 ] || die "no piece in $DIR (carry one: $DIR/piece.NNN)"
    have=$(for p in $(manifest_pieces "$PIECES"); do [ -f "$PIECES/$p" ] && echo "$p"; done | wc -l)
    echo "received $got piece(s); $have of $(manifest_pieces "$PIECES" | wc -l) now in $PIECES"
    ;;
  check)
    if [ -f "$DIR/MANIFEST" ] && ls "$DIR"/piece.* > /dev/null 2>&1; then src=$DIR; else src=$PIECES; fi
    tmp=$(mktemp -d) || die "mktemp failed"
    trap 'rm -rf "$tmp"' EXIT
    join_pieces "$src" "$src" "$tmp/bundle.tar"
    if [ -f "$DIR/bundle.tar" ] && [ "$src" = "$DIR" ]; then
      cmp -s "$tmp/bundle.tar" "$DIR/bundle.tar" || die "the pieces in $DIR joined differ from $DIR/bundle.tar"
    fi
    echo "ok: $(manifest_pieces "$src" | wc -l) pieces in $src join to the bundle (sha256 checked)"
    ;;
  install)
    want=$(awk '$2 == "bundle.tar" {print $1}' "$PIECES/MANIFEST" 2>/dev/null)
    [ -n "$want" ] || die "no MANIFEST in $PIECES: receive the pieces first (docs/gpu.md)"
    if [ -f "$SITE/.carry_wheel_ok" ] && [ "$(cat "$SITE/.carry_wheel_ok")" = "$want" ]; then
      echo "already installed in $SITE"
    else
      tmp=$(mktemp -d) || die "mktemp failed"
      trap 'rm -rf "$tmp"' EXIT
      join_pieces "$PIECES" "$PIECES" "$tmp/bundle.tar"
      tar -xf "$tmp/bundle.tar" -C "$tmp" || die "could not unpack the bundle"
      rm -rf "$SITE.part"
      "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE.part" \
          "$tmp"/wheels/*.whl || { rm -rf "$SITE.part"; die "pip install --target failed"; }
      # SITE/nvidia must not hide the image's own nvidia.* packages (nvidia.cu13, nvidia.cudnn...,
      # which torch and CuPy use): its __init__ extends the package's path over sys.path
      init="$SITE.part/nvidia/__init__.py"
      if [ -f "$init" ] && ! grep -q extend_path "$init"; then
        echo "__path__ = __import__('pkgutil').extend_path(__path__, __name__)" >> "$init"
      fi
      echo "$want" > "$SITE.part/.carry_wheel_ok"
      rm -rf "$SITE" && mv "$SITE.part" "$SITE" || die "could not move $SITE.part to $SITE"
      echo "installed $(ls "$tmp/wheels" | wc -l) wheels in $SITE"
    fi
    PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" "$PY" -c "import nvidia.dali as d; print('nvidia.dali', d.__version__)" \
      || die "nvidia.dali does not import from $SITE"
    echo "export PYTHONPATH=$SITE\${PYTHONPATH:+:\$PYTHONPATH}"
    ;;
  -h|--help) usage 0 ;;
  *) echo "carry_wheel.sh: unknown command '$cmd' (pack, cut, receive, check, install)" >&2; usage ;;
esac
