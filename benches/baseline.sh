# Sourced by the preload and JVM benchmarks: sets $jemalloc to Debian's
# libjemalloc.so.2 (the bare-jemalloc baseline, installed if missing) and $mq to a
# freshly built libmemquota.so.
jemalloc=$(ls /usr/lib/x86_64-linux-gnu/libjemalloc.so.2 2>/dev/null || true)
if [ -z "$jemalloc" ]; then
    echo "installing libjemalloc2 (Debian's jemalloc, the baseline)"
    SUDO=; [ "$(id -u)" -eq 0 ] || SUDO=sudo
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq libjemalloc2
    jemalloc=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2
fi
cargo build --release -q -p memquota-preload
mq=$PWD/target/release/libmemquota.so
