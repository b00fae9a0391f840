//! Links `libmemquota.so` so that jemalloc's read of its configuration variable
//! goes through `src/process/malloc_conf.rs` first (`MALLOC_CONF` is honoured there):
//! the one moment jemalloc reads its options, whichever call started it.

fn main() {
    // Every reference to secure_getenv in the link, which is jemalloc's only (Rust's
    // std uses getenv), goes to __wrap_secure_getenv; that one reaches the real
    // function as __real_secure_getenv.
    println!("cargo:rustc-link-arg-cdylib=-Wl,--wrap=secure_getenv");
    println!("cargo:rerun-if-changed=build.rs");
}
