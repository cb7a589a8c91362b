//! The process's memory allocator: mimalloc for every `ciliate` process (agent, proxies, CLI).
//!
//! glibc's malloc cost the HTTP proxy about a tenth of its time per proxied request (arena
//! locks, consolidation of freed chunks) and the agent a quarter of its work per L7 record
//! (`cargo bench --bench http_proxy`, perf). mimalloc's per-thread heaps take most of that
//! away. The global allocator is declared by the binary (`src/main.rs`) and by the benches that
//! run the agent in process (agent, policy, flows); tests and `benches/icount` keep the
//! system's. This module holds what the process does with it.
//!
//! Memory is handed back to the system: arenas are committed on demand, not eagerly
//! (`ARENA_EAGER_COMMIT` = 0), so a purge of freed pages decommits them and the RSS falls
//! (eager commit purges by reset, which leaves the pages in the RSS until the kernel wants
//! them: 10,000 parked proxy connections held 206 MiB instead of 126 MiB).

/// `mi_option_arena_eager_commit` in mimalloc v3's `mimalloc.h` (libmimalloc-sys does not name
/// it): 0 commits an arena's memory as it is used.
const MI_OPTION_ARENA_EAGER_COMMIT: libmimalloc_sys::mi_option_t = 4;

/// Sets mimalloc's options. It must run before the first allocation reserves an arena: the
/// binary calls it from the process's constructors (`.init_array`), ahead of Rust's own
/// start-up, which allocates.
pub extern "C" fn configure_allocator() {
    // SAFETY: sets one of mimalloc's option values; no memory is touched.
    unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_ARENA_EAGER_COMMIT, 0) }
}

/// Returns free memory to the system: mimalloc's (the binary's allocator) and glibc's (which
/// the C libraries and the test binaries use), so a burst such as the initial sync, or hyper's
/// buffers of connections parked since, does not stay in the RSS for good.
pub fn release_free_memory() {
    // SAFETY: mi_collect only frees the calling thread's and abandoned free pages; with
    // `force` it also purges the OS memory of empty pages.
    unsafe { libmimalloc_sys::mi_collect(true) }
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim only walks the allocator's own free lists.
    unsafe {
        nix::libc::malloc_trim(0);
    }
}
