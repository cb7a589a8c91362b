//! Compiles the eBPF datapath (`bpf/ciliate.bpf.c`, its parts in `bpf/lib/`) at build time into a libbpf skeleton
//! (`$OUT_DIR/ciliate.skel.rs`), with clang. `bpf/ciliate.h` is the single source of truth for
//! the structures user space shares with the program; Rust uses the skeleton's generated types.

use std::env;
use std::ffi::OsString;
use std::path::PathBuf;

use libbpf_cargo::SkeletonBuilder;

const SRC: &str = "bpf/ciliate.bpf.c";
const HEADER: &str = "bpf/ciliate.h";

fn main() {
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("OUT_DIR is set by cargo"))
        .join("ciliate.skel.rs");
    let arch = env::var("CARGO_CFG_TARGET_ARCH").expect("CARGO_CFG_TARGET_ARCH is set by cargo");
    // Debian keeps <asm/types.h> under the multiarch include directory.
    let multiarch = match arch.as_str() {
        "x86_64" => "x86_64-linux-gnu",
        "aarch64" => "aarch64-linux-gnu",
        other => other,
    };
    let args: Vec<OsString> = vec![
        "-I".into(),
        "bpf".into(),
        "-I".into(),
        format!("/usr/include/{multiarch}").into(),
        "-Wall".into(),
        "-Werror".into(),
    ];
    if let Err(e) = SkeletonBuilder::new()
        .source(SRC)
        .clang_args(args)
        .build_and_generate(&out)
    {
        panic!(
            "cannot compile the eBPF datapath {SRC}: {e:#}\n\
             (it needs clang and the Linux UAPI headers: `bash .ci/setup` installs them)"
        );
    }
    println!("cargo:rerun-if-changed={SRC}");
    println!("cargo:rerun-if-changed={HEADER}");
    // The program's parts by concern (parse, maps, ipcache, policy, events, conntrack).
    println!("cargo:rerun-if-changed=bpf/lib");
    println!("cargo:rerun-if-changed=build.rs");
}
