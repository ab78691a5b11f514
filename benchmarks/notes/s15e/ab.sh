#!/bin/bash
# s15c/ab.sh with an environment per arm: NAME:TREE[:FLAGS[:ENV]], ENV as K=V,K=V; rounds interleaved as there
R=$1; O=$2; shift 2; mkdir -p "$O/.one"
AB=$(dirname "$(readlink -f "$0")")/../s15c/ab.sh
for r in $(seq 1 "$R"); do
  for arm in "$@"; do
    name=${arm%%:*}; IFS=: read -r tree flags envs <<< "${arm#*:}"
    ENVX="${envs//,/ }" bash "$AB" 1 "$O/.one" "$name:$tree:$flags" | sed "s/ r1:/ r$r:/"
    mv "$O/.one/$name.1.json" "$O/$name.$r.json"; mv "$O/.one/$name.1.err" "$O/$name.$r.err"
  done
done
