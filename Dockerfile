# syntax=docker/dockerfile:1
# The ciliate image: the agent, the CLI and the CNI plugin (one binary). `make image`.
# Needs BuildKit (the default builder of current Docker) for the cache mounts.

# Build: the same toolchain and packages as .ci/setup. clang/llvm compile bpf/ at build time
# (build.rs); libelf-dev, zlib1g-dev, pkg-config and make build the vendored libbpf;
# libnftnl-dev and libmnl-dev are for masquerading (nftables over netlink).
ARG RUST_VERSION=1.95
FROM rust:${RUST_VERSION}-bookworm AS builder
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      clang llvm linux-libc-dev libelf-dev zlib1g-dev pkg-config make libnftnl-dev libmnl-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# The cache mounts keep the registry and target directory between builds; the binary is copied
# out because a cache mount does not end up in the image.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --bin ciliate \
 && cp target/release/ciliate /ciliate

# Run: libbpf is linked statically; libelf, zlib, libnftnl and libmnl dynamically.
FROM debian:bookworm-slim
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends libelf1 zlib1g libnftnl11 libmnl0 \
 && rm -rf /var/lib/apt/lists/*
COPY --from=builder /ciliate /usr/local/bin/ciliate
ENTRYPOINT ["/usr/local/bin/ciliate"]
