// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * BPF host routing (Cilium's, for the native-routing path), both ends of a pod-to-pod packet
 * between nodes:
 *
 * Sending (host_route, after from_container allowed the packet): a packet the pod sends to a
 * pod of another node goes from the pod's host veth straight out of the node's device with
 * bpf_redirect_neigh, skipping the host stack's forwarding path (routing, netfilter's hooks
 * and conntrack). Only destinations in host_routes (IPv4) and host_routes6 (IPv6) take it:
 * the other nodes' pod CIDRs the agent installed kernel routes for. The kernel's FIB still picks the
 * device and the next hop, so the packet leaves exactly where the route says; any lookup that
 * does not plainly succeed leaves the packet to the stack, as before. Traffic leaving the
 * cluster never matches (it keeps the stack, and so masquerading).
 *
 * Receiving (from_netdev, on the tc ingress of the node's device): a packet addressed
 * to a pod of this node (local_endpoints) meets that pod's ingress policy right there, the
 * same decision to_container makes (same policy map, same conntrack entries), and once
 * allowed goes into the pod with bpf_redirect_peer, skipping this node's stack. Anything else
 * (not for a local pod, not addressed to this host's MAC, about to expire) is left alone for
 * the next program or the stack.
 */
#ifndef CILIATE_LIB_HOSTROUTE_H
#define CILIATE_LIB_HOSTROUTE_H

#include <linux/in.h>

#ifndef AF_INET
#define AF_INET 2
#endif
#ifndef AF_INET6
#define AF_INET6 10
#endif

struct host_route_key {
	__u32 prefixlen;
	__u32 addr; /* network order */
};

PINNED_MAP(BPF_MAP_TYPE_LPM_TRIE, 16384, struct host_route_key, __u32, BPF_F_NO_PREALLOC) host_routes SEC(".maps");

struct host_route6_key {
	__u32 prefixlen;
	__u8 addr[16];
};

PINNED_MAP(BPF_MAP_TYPE_LPM_TRIE, 16384, struct host_route6_key, __u32, BPF_F_NO_PREALLOC) host_routes6 SEC(".maps");

/* Packets sent by host routing (one slot, for tests and `bpf` introspection). */
PINNED_COUNTER(1) host_routed SEC(".maps");

/* This node's pods by IPv4 address (struct local_endpoint), written by the agent once an
 * endpoint's programs are in place and removed before they go. */
PINNED_MAP(BPF_MAP_TYPE_HASH, CILIATE_ENDPOINTS_MAX, __u32, struct local_endpoint, BPF_F_NO_PREALLOC) local_endpoints SEC(".maps");

/* The same by IPv6 address. */
struct local_endpoint6_key {
	__u8 addr[16];
};

PINNED_MAP(BPF_MAP_TYPE_HASH, CILIATE_ENDPOINTS_MAX, struct local_endpoint6_key, struct local_endpoint, BPF_F_NO_PREALLOC) local_endpoints6 SEC(".maps");

/* Packets delivered into a pod by from_netdev (one slot, like host_routed). */
PINNED_COUNTER(1) host_delivered SEC(".maps");

static __always_inline void bump(void *counter)
{
	__u32 zero = 0;
	__u64 *n = bpf_map_lookup_elem(counter, &zero);
	if (n)
		*n += 1;
}

/* Forwarding decrements the TTL; the checksum follows (ttl is the high byte of its word).
 * 0: done; 1: nothing changed (leave the packet to the stack); -1: the packet is broken. */
static __always_inline int ttl_decrement(struct __sk_buff *skb, __u8 ttl)
{
	__u8 next = ttl - 1;
	if (bpf_l3_csum_replace(skb, ETH_HLEN + offsetof(struct iphdr, check),
				bpf_htons((__u16)ttl << 8), bpf_htons((__u16)next << 8), 2) < 0)
		return 1;
	if (bpf_skb_store_bytes(skb, ETH_HLEN + offsetof(struct iphdr, ttl), &next, 1, 0) < 0)
		return -1; /* the checksum already changed: never send it half-rewritten */
	return 0;
}

/* The IPv4 header of a packet the stack would forward (TTL above 1), or 0. */
static __always_inline struct iphdr *forwardable_ipv4(struct __sk_buff *skb)
{
	struct iphdr *ip = ipv4_header(skb);
	if (!ip)
		return 0;
	/* A packet about to expire is the stack's to answer (ICMP time exceeded). */
	if (ip->ttl <= 1)
		return 0;
	return ip;
}

/* The IPv6 header of a packet the stack would forward (hop limit above 1), or 0. */
static __always_inline struct ipv6hdr *forwardable_ipv6(struct __sk_buff *skb)
{
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > end || eth->h_proto != bpf_htons(ETH_P_IPV6))
		return 0;
	struct ipv6hdr *ip6 = (void *)(eth + 1);
	if ((void *)(ip6 + 1) > end || ip6->hop_limit <= 1)
		return 0;
	return ip6;
}

/* local_endpoint_of for IPv6 (by local_endpoints6). A global function: the IPv4 path carries
 * none of it. */
__attribute__((noinline)) int ciliate_local_endpoint6(struct __sk_buff *skb, struct local_endpoint *out)
{
	if (!out)
		return 0;
	struct ipv6hdr *ip6 = forwardable_ipv6(skb);
	if (!ip6)
		return 0;
	struct local_endpoint6_key k;
	__builtin_memcpy(k.addr, &ip6->daddr, 16);
	struct local_endpoint *le = bpf_map_lookup_elem(&local_endpoints6, &k);
	if (!le || !le->endpoint_id || !le->ifindex)
		return 0;
	*out = *le;
	return 1;
}

/* The local pod a packet arriving on the node's device is for, copied into *out (the map's
 * record may be rewritten meanwhile); 0 when it is not for one. */
static __always_inline int local_endpoint_of(struct __sk_buff *skb, struct local_endpoint *out)
{
	/* Frames for another host's MAC (a bridge floods unknown unicast) are not ours. */
	if (skb->pkt_type != 0 /* PACKET_HOST */)
		return 0;
	struct iphdr *ip = forwardable_ipv4(skb);
	if (!ip)
		return ciliate_local_endpoint6(skb, out);
	__u32 daddr = ip->daddr;
	/* The node's own address is no pod's (and spares the lookup on the host firewall's
	 * paths). */
	if (node_address4(daddr))
		return 0;
	struct local_endpoint *le = bpf_map_lookup_elem(&local_endpoints, &daddr);
	if (!le || !le->endpoint_id || !le->ifindex)
		return 0;
	*out = *le;
	return 1;
}

/* The pod's MACs on a packet delivered into it, counted, and off it goes into the pod. */
static __always_inline int deliver_to(struct __sk_buff *skb, const struct local_endpoint *le)
{
	if (bpf_skb_store_bytes(skb, 0, le->mac, 6, 0) < 0 ||
	    bpf_skb_store_bytes(skb, 6, le->node_mac, 6, 0) < 0)
		return TC_ACT_SHOT;
	bump(&host_delivered);
	return bpf_redirect_peer(le->ifindex, 0);
}

/* local_deliver for IPv6: the hop limit as forwarding would (no header checksum). A global
 * function, as ciliate_local_endpoint6. */
__attribute__((noinline)) int ciliate_local_deliver6(struct __sk_buff *skb, const struct local_endpoint *le)
{
	if (!le)
		return TC_ACT_OK;
	struct ipv6hdr *ip6 = forwardable_ipv6(skb);
	if (!ip6)
		return TC_ACT_OK;
	__u8 next = ip6->hop_limit - 1;
	if (bpf_skb_store_bytes(skb, ETH_HLEN + offsetof(struct ipv6hdr, hop_limit), &next, 1, 0) < 0)
		return TC_ACT_SHOT;
	return deliver_to(skb, le);
}

/* Delivers an allowed packet into the pod: TTL as forwarding would, the pod's gateway MAC as
 * source, the pod's MAC as destination, then straight into the pod's namespace. */
static __always_inline int local_deliver(struct __sk_buff *skb, const struct local_endpoint *le)
{
	struct iphdr *ip = forwardable_ipv4(skb);
	if (!ip)
		return ciliate_local_deliver6(skb, le);
	int r = ttl_decrement(skb, ip->ttl);
	if (r)
		return r < 0 ? TC_ACT_SHOT : TC_ACT_OK;
	return deliver_to(skb, le);
}

/* host_route for IPv6: no header checksum, the hop limit instead of the TTL. A global
 * function: verified once, on its own, and the IPv4 path does not carry its instructions. */
__attribute__((noinline)) int ciliate_host_route6(struct __sk_buff *skb)
{
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > end || eth->h_proto != bpf_htons(ETH_P_IPV6))
		return TC_ACT_OK;
	struct ipv6hdr *ip6 = (void *)(eth + 1);
	if ((void *)(ip6 + 1) > end)
		return TC_ACT_OK;
	/* A packet about to expire is the stack's to answer (ICMPv6 time exceeded). */
	__u8 hops = ip6->hop_limit;
	if (hops <= 1)
		return TC_ACT_OK;
	struct host_route6_key k = { .prefixlen = 128 };
	__builtin_memcpy(k.addr, &ip6->daddr, 16);
	if (!bpf_map_lookup_elem(&host_routes6, &k))
		return TC_ACT_OK;
	struct bpf_fib_lookup f = {};
	f.family = AF_INET6;
	f.flowinfo = *(__be32 *)ip6 & bpf_htonl(0x0FFFFFFF);
	f.l4_protocol = ip6->nexthdr;
	/* tot_len 0: the kernel checks the packet against the device's MTU itself, and lets a GSO
	 * packet (segmented later) through; with a length given, every GSO packet would fail the
	 * check and take the stack. */
	__builtin_memcpy(f.ipv6_src, &ip6->saddr, 16);
	__builtin_memcpy(f.ipv6_dst, &ip6->daddr, 16);
	f.ifindex = skb->ingress_ifindex;
	if (bpf_fib_lookup(skb, &f, sizeof(f), 0) != BPF_FIB_LKUP_RET_SUCCESS)
		return TC_ACT_OK;
	__u8 next = hops - 1;
	if (bpf_skb_store_bytes(skb, ETH_HLEN + offsetof(struct ipv6hdr, hop_limit), &next, 1, 0) < 0)
		return TC_ACT_SHOT;
	bump(&host_routed);
	return bpf_redirect_neigh(f.ifindex, 0, 0, 0);
}

/* Tunnel mode's encapsulation in BPF (lib/tunnel.h). */
int ciliate_tunnel_encap4(struct __sk_buff *skb, const struct bpf_fib_lookup *f);

static __always_inline int host_route(struct __sk_buff *skb)
{
	struct iphdr *ip = forwardable_ipv4(skb);
	if (!ip)
		return ciliate_host_route6(skb);
	struct host_route_key k = { .prefixlen = 32, .addr = ip->daddr };
	if (!bpf_map_lookup_elem(&host_routes, &k))
		return TC_ACT_OK;
	struct bpf_fib_lookup f = {};
	f.family = AF_INET;
	f.tos = ip->tos;
	f.l4_protocol = ip->protocol;
	/* tot_len 0, as for IPv6: a GSO packet is host-routed too. */
	f.ipv4_src = ip->saddr;
	f.ipv4_dst = ip->daddr;
	f.ifindex = skb->ingress_ifindex;
	__u8 ttl = ip->ttl;
	if (bpf_fib_lookup(skb, &f, sizeof(f), 0) != BPF_FIB_LKUP_RET_SUCCESS)
		return TC_ACT_OK;
	int r = ttl_decrement(skb, ttl);
	if (r)
		return r < 0 ? TC_ACT_SHOT : TC_ACT_OK;
	bump(&host_routed);
	/* Through the tunnel: encapsulated here when BPF does the tunnel's work. */
	r = ciliate_tunnel_encap4(skb, &f);
	if (r >= 0)
		return r;
	return bpf_redirect_neigh(f.ifindex, 0, 0, 0);
}

#endif /* CILIATE_LIB_HOSTROUTE_H */
