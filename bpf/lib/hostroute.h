// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * BPF host routing (Cilium's, for the native-routing path): an IPv4 packet the pod sends to a
 * pod of another node, once policy allowed it, goes from the pod's host veth straight out of
 * the node's device with bpf_redirect_neigh, skipping the host stack's forwarding path
 * (routing, netfilter's hooks and conntrack). Only destinations in host_routes take it: the
 * other nodes' pod CIDRs the agent installed kernel routes for (native routing). The kernel's
 * FIB still picks the device and the next hop, so the packet leaves exactly where the route
 * says; any lookup that does not plainly succeed leaves the packet to the stack, as before.
 * Traffic leaving the cluster never matches (it keeps the stack, and so masquerading), and
 * the receiving node's to_container program judges the packet as before.
 */
#ifndef CILIATE_LIB_HOSTROUTE_H
#define CILIATE_LIB_HOSTROUTE_H

#include <linux/in.h>

#ifndef AF_INET
#define AF_INET 2
#endif

struct host_route_key {
	__u32 prefixlen;
	__u32 addr; /* network order */
};

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, 16384);
	__type(key, struct host_route_key);
	__type(value, __u32);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} host_routes SEC(".maps");

/* Packets sent by host routing (one slot, for tests and `bpf` introspection). */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} host_routed SEC(".maps");

static __always_inline int host_route(struct __sk_buff *skb)
{
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > end || eth->h_proto != bpf_htons(ETH_P_IP))
		return TC_ACT_OK;
	struct iphdr *ip = (void *)(eth + 1);
	if ((void *)(ip + 1) > end)
		return TC_ACT_OK;
	/* A packet about to expire is the stack's to answer (ICMP time exceeded). */
	if (ip->ttl <= 1)
		return TC_ACT_OK;
	struct host_route_key k = { .prefixlen = 32, .addr = ip->daddr };
	if (!bpf_map_lookup_elem(&host_routes, &k))
		return TC_ACT_OK;
	struct bpf_fib_lookup f = {};
	f.family = AF_INET;
	f.tos = ip->tos;
	f.l4_protocol = ip->protocol;
	f.tot_len = bpf_ntohs(ip->tot_len);
	f.ipv4_src = ip->saddr;
	f.ipv4_dst = ip->daddr;
	f.ifindex = skb->ingress_ifindex;
	if (bpf_fib_lookup(skb, &f, sizeof(f), 0) != BPF_FIB_LKUP_RET_SUCCESS)
		return TC_ACT_OK;
	/* Forwarding decrements the TTL; the checksum follows (ttl is the high byte of its word). */
	__u8 ttl = ip->ttl;
	__u8 next = ttl - 1;
	if (bpf_l3_csum_replace(skb, ETH_HLEN + offsetof(struct iphdr, check),
				bpf_htons((__u16)ttl << 8), bpf_htons((__u16)next << 8), 2) < 0)
		return TC_ACT_OK;
	if (bpf_skb_store_bytes(skb, ETH_HLEN + offsetof(struct iphdr, ttl), &next, 1, 0) < 0)
		return TC_ACT_SHOT; /* the checksum already changed: never send it half-rewritten */
	__u32 zero = 0;
	__u64 *n = bpf_map_lookup_elem(&host_routed, &zero);
	if (n)
		*n += 1;
	return bpf_redirect_neigh(f.ifindex, 0, 0, 0);
}

#endif /* CILIATE_LIB_HOSTROUTE_H */
