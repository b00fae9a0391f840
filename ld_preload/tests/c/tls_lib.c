/* A dlopen'ed library with (global-dynamic) TLS: its blocks are allocated lazily. */
static __thread char big[1 << 16];
static __thread int counter;
int tls_touch(int v) { big[v & 0xffff] = (char)v; counter += 1; return counter + (big[v & 0xffff] != 0); }
