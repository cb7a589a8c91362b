//! Compiles the eBPF datapath at build time into libbpf skeletons, with clang:
//! `bpf/ciliate.bpf.c` (the tc programs, its parts by concern in `bpf/lib/`) into `$OUT_DIR/ciliate.skel.rs` and
//! `bpf/services.bpf.c` (socket-level service translation) into `$OUT_DIR/services.skel.rs`.
//! `bpf/ciliate.h` and `bpf/services.h` are the single source of truth for the structures user
//! space shares with the programs; Rust uses the skeletons' generated types.
//! Also generates Hubble's gRPC API (`proto/`) for `src/hubble`.

use std::env;
use std::ffi::OsString;
use std::path::PathBuf;

use libbpf_cargo::SkeletonBuilder;

/// (source, header, skeleton file name)
const PROGRAMS: [(&str, &str, &str); 2] = [
    ("bpf/ciliate.bpf.c", "bpf/ciliate.h", "ciliate.skel.rs"),
    ("bpf/services.bpf.c", "bpf/services.h", "services.skel.rs"),
];

fn main() {
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("OUT_DIR is set by cargo"));
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
    for (src, header, skel) in PROGRAMS {
        if let Err(e) = SkeletonBuilder::new()
            .source(src)
            .clang_args(args.clone())
            .build_and_generate(out_dir.join(skel))
        {
            panic!(
                "cannot compile the eBPF datapath {src}: {e:#}\n\
                 (it needs clang and the Linux UAPI headers: `bash .ci/setup` installs them)"
            );
        }
        println!("cargo:rerun-if-changed={src}");
        println!("cargo:rerun-if-changed={header}");
    }
    // The tc program's parts by concern (parse, maps, ipcache, policy, events, conntrack).
    println!("cargo:rerun-if-changed=bpf/lib");
    println!("cargo:rerun-if-changed=build.rs");
    hubble_protos();
}

/// Hubble's API (`proto/`, the packages `flow`, `observer`, `peer`, `relay`) into
/// `$OUT_DIR/<package>.rs`: messages (prost) and both sides of the services (tonic). protox
/// parses the protos in Rust (it carries Google's well-known types), so no protoc is needed.
fn hubble_protos() {
    const PROTOS: [&str; 4] = [
        "proto/flow/flow.proto",
        "proto/relay/relay.proto",
        "proto/peer/peer.proto",
        "proto/observer/observer.proto",
    ];
    let fds = protox::compile(PROTOS, ["proto"])
        .unwrap_or_else(|e| panic!("cannot parse Hubble's protos in proto/: {e}"));
    tonic_prost_build::configure()
        // A response carries a flow of some hundred bytes: boxed, so that a response moves
        // through the server's channel and buffers as a pointer.
        .boxed(".observer.GetFlowsResponse.response_types.flow")
        .compile_fds(fds)
        .unwrap_or_else(|e| panic!("cannot generate Hubble's API from proto/: {e}"));
    println!("cargo:rerun-if-changed=proto");
}
