// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/* The peer's identity: the host table first (exact /32 or /128), then the prefix trie. */
#ifndef CILIATE_LIB_IPCACHE_H
#define CILIATE_LIB_IPCACHE_H

static __always_inline __u32 peer_identity(struct packet *p, int egress)
{
	struct ipcache_host_key hk = {};
	hk.family = p->family;
	__builtin_memcpy(hk.addr, egress ? p->daddr : p->saddr, 16);
	struct ipcache_value *hv = bpf_map_lookup_elem(&ipcache_hosts, &hk);
	if (hv)
		return hv->identity;
	struct ipcache_key k = {};
	k.family = p->family;
	k.prefixlen = 32 + (p->family == 4 ? 32 : 128);
	__builtin_memcpy(k.addr, egress ? p->daddr : p->saddr, 16);
	struct ipcache_value *v = bpf_map_lookup_elem(&ipcache, &k);
	if (v)
		return v->identity;
	return p->family == 4 ? CILIATE_ID_WORLD_IPV4 : CILIATE_ID_WORLD_IPV6;
}

/* Whether the IPv4 address `addr` (network order) is in the ipcache's host table with identity
 * host: the slow path of node_address4, for nodes with more addresses than its record holds. A
 * global function: the verifier checks it once, on its own, not along every path through the
 * program that calls it. */
__attribute__((noinline)) int ciliate_host_table_address4(__u32 addr)
{
	struct ipcache_host_key hk = {};
	hk.family = 4;
	__builtin_memcpy(hk.addr, &addr, 4);
	struct ipcache_value *v = bpf_map_lookup_elem(&ipcache_hosts, &hk);
	return v && v->identity == CILIATE_ID_HOST;
}

/* Whether the IPv4 address `addr` (network order) is one of this node's (identity host): a
 * few compares against the record's slots, without a branch per slot (each would multiply
 * the paths the verifier follows through the rest of the program). */
static __always_inline int node_address4(__u32 addr)
{
	__u32 zero = 0;
	struct host_addrs4 *h = bpf_map_lookup_elem(&host_addrs4, &zero);
	if (!h)
		return 0;
	if (h->overflow)
		return ciliate_host_table_address4(addr);
	/* x != 0 exactly when the top bit of (x | -x) is set; 0.0.0.0 (an empty slot) is never
	 * the node's. */
	__u32 missed = 1 ^ ((addr | (0 - addr)) >> 31);
	__u32 all = 1;
#pragma unroll
	for (int i = 0; i < CILIATE_HOST_ADDRS4_MAX; i++) {
		__u32 x = h->addr[i] ^ addr;
		all &= (x | (0 - x)) >> 31;
	}
	return (missed | all) ^ 1;
}

#endif /* CILIATE_LIB_IPCACHE_H */
