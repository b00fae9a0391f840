# Sourced by the preload and JVM benchmarks: sets $jemalloc to Debian's
# libjemalloc.so.2 (the bare-jemalloc baseline, installed if missing) and $mq to a
# freshly built libmemquota.so.
# Also defines install_packages, for the other Debian packages a benchmark needs.
install_packages() {
    local sudo=; [ "$(id -u)" -eq 0 ] || sudo=sudo
    $sudo apt-get update -qq && $sudo apt-get install -y -qq "$@"
}
jemalloc=$(ls /usr/lib/x86_64-linux-gnu/libjemalloc.so.2 2>/dev/null || true)
if [ -z "$jemalloc" ]; then
    echo "installing libjemalloc2 (Debian's jemalloc, the baseline)"
    install_packages libjemalloc2
    jemalloc=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2
fi
cargo build --release -q -p memquota-preload
mq=$PWD/target/release/libmemquota.so
