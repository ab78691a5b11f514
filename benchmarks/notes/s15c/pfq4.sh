cd /tmp
for pf in "$@"; do
  sed -i "s/^PF_BYTES = .*/PF_BYTES = $pf/" /work/s15c/waste/quant/q4_int8.py
  env PYTHONPATH=/work/s15c PYTHONSAFEPATH=1 nice -n 5 python /tmp/s15c/pairscale.py > /dev/null 2>&1   # compile, niced
  echo "PF $pf: $(flock /tmp/waste-bench.lock /tmp/quiet.sh env PYTHONPATH=/work/s15c PYTHONSAFEPATH=1 python /tmp/s15c/pairscale.py | tr '\n' ';')"
done
