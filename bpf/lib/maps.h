// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/* Every map of the datapath, pinned by name under <bpf-root>/ciliate/ (shared by each
 * endpoint's program instance, outliving the agent), and the ABI anchors for the skeleton. */
#ifndef CILIATE_LIB_MAPS_H
#define CILIATE_LIB_MAPS_H

struct policy_inner {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, CILIATE_POLICY_MAP_MAX);
	__uint(key_size, sizeof(struct policy_key));
	__uint(value_size, sizeof(struct policy_value));
};

/* Instances that only exist so the skeleton generates Rust definitions of these types. */
struct policy_key _abi_policy_key = {};
struct ipcache_host_key _abi_ipcache_host_key = {};
struct policy_value _abi_policy_value = {};
struct verdict_event _abi_verdict_event = {};
struct verdict_event4 _abi_verdict_event4 = {};
struct local_endpoint _abi_local_endpoint = {};
struct l7_proxy_config _abi_l7_proxy_config = {};
struct ct_value _abi_ct_value = {};
struct host_addrs4 _abi_host_addrs4 = {};

/* Endpoint ids are 16-bit, so both per-endpoint tables are arrays indexed by the id: the
 * verifier inlines their lookups (no hashing), which a new connection's two lookups feel. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY_OF_MAPS);
	__uint(max_entries, CILIATE_ENDPOINTS_MAX);
	__type(key, __u32);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
	__array(values, struct policy_inner);
} policy_maps SEC(".maps");

PINNED_MAP(BPF_MAP_TYPE_LPM_TRIE, CILIATE_IPCACHE_MAX, struct ipcache_key, struct ipcache_value, BPF_F_NO_PREALLOC) ipcache SEC(".maps");

PINNED_MAP(BPF_MAP_TYPE_HASH, CILIATE_IPCACHE_MAX, struct ipcache_host_key, struct ipcache_value, BPF_F_NO_PREALLOC) ipcache_hosts SEC(".maps");

/* The node's own IPv4 addresses (struct host_addrs4; lib/ipcache.h). */
PINNED_MAP(BPF_MAP_TYPE_ARRAY, 1, __u32, struct host_addrs4, 0) host_addrs4 SEC(".maps");

/* A slot whose identity is 0 holds no endpoint. User space rewrites a record in place, so the
 * program may read a mix of an old and a new record's fields: the writer orders its updates
 * so that every such mix is safe (see sync_policy in datapath.rs). */
PINNED_MAP(BPF_MAP_TYPE_ARRAY, CILIATE_ENDPOINTS_MAX, __u32, struct endpoint_info, 0) endpoints SEC(".maps");

/* Conntrack, IPv4: a preallocated hash, not an LRU: an LRU insert rotates its lists and touches
 * many cold nodes (about 300 ns of a new connection's cost). Expiry is the agent's garbage
 * collector's job; a full table leaves new connections untracked (CILIATE_CT_FULL), never
 * allowed more. */
PINNED_MAP(BPF_MAP_TYPE_HASH, CILIATE_CT_MAX, struct ct4_key, struct ct_value, 0) conntrack4 SEC(".maps");

/* Conntrack, IPv6: allocated per entry here, so a node without IPv6 pays no memory for it; the
 * loader preallocates it instead for an agent with --enable-ipv6 (src/datapath/bpf.rs:
 * an insert allocated per entry costs a new IPv6 connection about 90 ns). */
PINNED_MAP(BPF_MAP_TYPE_HASH, CILIATE_CT_MAX, struct ct6_key, struct ct_value, BPF_F_NO_PREALLOC) conntrack6 SEC(".maps");

PINNED_COUNTER(CILIATE_REASON_MAX) verdict_counters SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, CILIATE_EVENTS_BYTES);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} events SEC(".maps");

/* One CPU's verdict events on their way to the ring buffer (lib/events.h). Only programs and
 * the flush timer of that CPU touch it, never at once: a tc program runs with bottom halves
 * off and the timer (pinned to the CPU) runs as a softirq. */
struct event_batch {
	struct bpf_timer timer;
	/* When the first waiting event was decided: every event of the batch carries it (the
	 * batch leaves within CILIATE_EVENT_FLUSH_NS, so no event's time is off by more). */
	__u64 first_ns;
	__u32 used;	/* bytes of buf[] waiting: the marker and the events */
	__u16 count;	/* events waiting */
	__u8 timer_ready; /* bpf_timer_init done */
	__u8 armed;	/* the flush timer is started */
	/* The form of the events in buf (CILIATE_EVENT_FORM, set as a batch starts). The field
	 * also makes this struct larger than the first form's, so that the loader never lets
	 * programs of two forms share batches: an upgrade sets the old map aside (work in
	 * flight, datapath/bpf/migrate.rs) and the old programs' batches leave as they were. */
	__u32 form;
	__u32 pad;
	/* Room past CILIATE_EVENT_BATCH_BYTES for one more event at any offset below it. */
	__u8 buf[CILIATE_EVENT_BATCH_BYTES + sizeof(struct verdict_event)];
};

/* Indexed by CPU; the loader sizes it to the possible CPUs. */
PINNED_MAP(BPF_MAP_TYPE_ARRAY, CILIATE_EVENT_BATCH_CPUS, __u32, struct event_batch, 0) event_batches SEC(".maps");

PINNED_MAP(BPF_MAP_TYPE_ARRAY, 1, __u32, struct datapath_config, 0) settings SEC(".maps");

PINNED_MAP(BPF_MAP_TYPE_ARRAY, 1, __u32, struct dns_proxy_config, 0) dns_proxy SEC(".maps");

PINNED_MAP(BPF_MAP_TYPE_ARRAY, 1, __u32, struct l7_proxy_config, 0) l7_proxy SEC(".maps");

#endif /* CILIATE_LIB_MAPS_H */
