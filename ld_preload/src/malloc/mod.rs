//! The malloc family: C's and glibc's allocation functions, C++ `new` and `delete`,
//! jemalloc's own API, and the per-thread state and charging code they share with the
//! other faces of the library.
//!
//! Imports go down this list, never up (no cycle):
//!
//! | module | job | uses |
//! | --- | --- | --- |
//! | `cxx` | C++ `operator new`/`delete` (all 20) | `exports`, `cxx_runtime` |
//! | `cxx_runtime` | the C++ runtime a refused `new` throws `std::bad_alloc` with | `thread` |
//! | `jemalloc_api` | `mallocx` ... `mallctl` for programs linked with jemalloc | `charge`, `lazy`, `thread` |
//! | `exports` | the exported symbol tables and the naked `malloc`/`free` | `charge`, `thread` |
//! | `charge` | the counted paths, the slow path, and the `FACE` table | `lazy`, `thread` |
//! | `lazy` | bulk counting's guards and the face's hooks on the thread's slot | `thread` |
//! | `thread` | the per-thread slot in initial-exec TLS, the exit flush | nothing here |

pub(crate) mod charge;
pub mod cxx;
mod cxx_runtime;
pub mod exports;
pub mod jemalloc_api;
pub(crate) mod lazy;
pub(crate) mod thread;
