// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * Tunnel mode, receive side in BPF (Cilium's bpf_overlay, done one device earlier): a VXLAN
 * packet from another node (a tunnel peer) to this node's address whose inner packet is TCP for
 * a pod of this node is decapsulated at the tc ingress of the device it arrives on, and
 * from_netdev then judges and delivers the inner packet as it does a natively routed one. It
 * skips what the kernel's VXLAN costs each packet: the outer packet's IP receive, netfilter,
 * route lookup and UDP socket lookup, vxlan_rcv and the tunnel device's second NAPI pass.
 *
 * Only what the kernel's device would have accepted and handed on unchanged is taken: outer
 * IPv4 without options or fragments, UDP to CILIATE_TUNNEL_PORT, the VXLAN header with the
 * I flag and ciliate's VNI alone, from a node in tunnel_peers, to this node's address; inner
 * IPv4 TCP for a local endpoint with a TTL above 1, all in the packet's linear part. Anything
 * else (other inner protocols, IPv6, the node's own traffic) is left untouched for the
 * kernel's device. A decapsulated packet that from_netdev does not deliver itself goes into
 * the tunnel device's ingress (bpf_redirect), exactly where the kernel would have put it, so
 * the stack takes it from the device its reverse path goes through: one decide() left
 * undecided (judged there as before), or one decided for the HTTP proxy (marked so; not judged
 * twice: ciliate_tunnel_decided).
 *
 * And what the kernel's device would have accepted from anyone is not: a packet to the tunnel's
 * port on this node's address from a sender that is no tunnel peer is dropped here, counted and
 * reported (CILIATE_DROP_TUNNEL_NOT_A_PEER, ciliate_tunnel_reject), whatever it carries. The
 * kernel's device takes VXLAN from any sender, and its inner packet would meet the pods' policy
 * under the identity of its inner source address: any host that reaches the node's UDP port
 * could speak as any pod of the cluster. (Only where the tunnel runs in BPF: IPv4 underlay.)
 *
 * Decapsulating a GSO packet (a GRO'd train of VXLAN segments) keeps its inner segment size
 * (BPF_F_ADJ_ROOM_FIXED_GSO); it is only ever delivered into a local pod, never forwarded
 * again, so no tunnel segmentation is asked of it.
 */
#ifndef CILIATE_LIB_TUNNEL_H
#define CILIATE_LIB_TUNNEL_H

#include <linux/udp.h>

/* ciliate's VXLAN network identifier (network::tunnel::VXLAN_VNI). */
#define CILIATE_TUNNEL_VNI 2

/* The agent's tunnel device and the node's underlay address (struct tunnel_config; ifindex 0
 * outside tunnel mode), written by the agent once the device is up and from_netdev is on it. */
PINNED_MAP(BPF_MAP_TYPE_ARRAY, 1, __u32, struct tunnel_config, 0) tunnel_config SEC(".maps");

/* Packets encapsulated here (one slot). */
PINNED_COUNTER(1) tunnel_encapped SEC(".maps");

/* Packets decapsulated here (one slot, like host_delivered). */
PINNED_COUNTER(1) tunnel_decapped SEC(".maps");

struct vxlan_header {
	__u8 flags;
	__u8 reserved1[3];
	__u8 vni[3];
	__u8 reserved2;
};

/* Outer IPv4, UDP, VXLAN and inner Ethernet headers: what decapsulation removes. */
#define TUNNEL_OUTER4_LEN (sizeof(struct iphdr) + sizeof(struct udphdr) + \
			   sizeof(struct vxlan_header) + ETH_HLEN)

/* Whether the packet may be the tunnel's (IPv4, UDP to CILIATE_TUNNEL_PORT): the inline test
 * every other packet of the node's device pays instead of a call. */
static __always_inline int tunnel_candidate(struct __sk_buff *skb)
{
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	struct iphdr *ip = data + ETH_HLEN;
	struct udphdr *udp = (void *)(ip + 1);
	if ((void *)(udp + 1) > end)
		return 0;
	return ip->protocol == IPPROTO_UDP && udp->dest == bpf_htons(CILIATE_TUNNEL_PORT);
}

/* ciliate_tunnel_decap4's answer for a packet to the tunnel's port on this node's address from
 * a sender that is no tunnel peer (to be dropped: CILIATE_DROP_TUNNEL_NOT_A_PEER). */
#define TUNNEL_NOT_A_PEER -2

/* Decapsulates a tunnel packet for a local pod (see above): the tunnel device's ifindex, with
 * the pod in *out; 0 when the packet is not one (left untouched); -1 when it broke on the way
 * (to be dropped); TUNNEL_NOT_A_PEER. A global function: verified once, and the other paths of
 * from_netdev carry none of it. */
__attribute__((noinline)) int ciliate_tunnel_decap4(struct __sk_buff *skb, struct local_endpoint *out)
{
	if (!out || skb->pkt_type != 0 /* PACKET_HOST */)
		return 0;
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	struct iphdr *ip = (void *)(eth + 1);
	struct udphdr *udp = (void *)(ip + 1);
	if ((void *)(udp + 1) > end)
		return 0;
	if (eth->h_proto != bpf_htons(ETH_P_IP) || ip->ihl != 5 || ip->protocol != IPPROTO_UDP ||
	    (ip->frag_off & bpf_htons(0x3fff)) || udp->dest != bpf_htons(CILIATE_TUNNEL_PORT))
		return 0;
	__u32 saddr = ip->saddr, daddr = ip->daddr;
	__u32 zero = 0;
	struct tunnel_config *t = bpf_map_lookup_elem(&tunnel_config, &zero);
	if (!t || !t->ifindex || !node_address4(daddr))
		return 0;
	__u32 ifindex = t->ifindex;
	/* The tunnel's port on this node's address from a node it does not tunnel to: whatever
	 * it carries would enter the pods under the inner source's identity. */
	if (!ciliate_tunnel_peer4(saddr))
		return TUNNEL_NOT_A_PEER;
	data = (void *)(long)skb->data;
	end = (void *)(long)skb->data_end;
	struct vxlan_header *vx = data + ETH_HLEN + sizeof(struct iphdr) + sizeof(struct udphdr);
	struct ethhdr *ieth = (void *)(vx + 1);
	struct iphdr *iip = (void *)(ieth + 1);
	if ((void *)(iip + 1) > end)
		return 0;
	if (vx->flags != 0x08 || vx->vni[0] || vx->vni[1] || vx->vni[2] != CILIATE_TUNNEL_VNI)
		return 0;
	if (ieth->h_proto != bpf_htons(ETH_P_IP) || iip->protocol != IPPROTO_TCP || iip->ttl <= 1)
		return 0;
	__u32 inner = iip->daddr;
	struct local_endpoint *le = bpf_map_lookup_elem(&local_endpoints, &inner);
	if (!le || !le->endpoint_id || !le->ifindex)
		return 0;
	*out = *le;
	/* The inner frame's addresses on the outer header, which stays (its EtherType is the
	 * inner's, IPv4): the frame is then the one the tunnel device would have received. */
	__u8 macs[12];
	if (bpf_skb_load_bytes(skb, ETH_HLEN + TUNNEL_OUTER4_LEN - ETH_HLEN, macs, 12) < 0)
		return 0;
	if (bpf_skb_adjust_room(skb, -(__s32)TUNNEL_OUTER4_LEN, BPF_ADJ_ROOM_MAC,
				BPF_F_ADJ_ROOM_FIXED_GSO) < 0)
		return 0;
	if (bpf_skb_store_bytes(skb, 0, macs, 12, 0) < 0)
		return -1;
	bump(&tunnel_decapped);
	return ifindex;
}

/* Drops a packet ciliate_tunnel_decap4 found to be from no tunnel peer: counted, and reported
 * as the node's (the host endpoint's) ingress drop of the outer packet, its sender's identity
 * from the ipcache. A global function, as ciliate_tunnel_decap4. */
__attribute__((noinline)) int ciliate_tunnel_reject(struct __sk_buff *skb)
{
	struct packet p = {};
	count(CILIATE_DROP_TUNNEL_NOT_A_PEER);
	if (skb && parse(skb, &p) == 0)
		emit(&p, CILIATE_HOST_ENDPOINT_ID, peer_identity(&p, 0), 0,
		     CILIATE_DROP_TUNNEL_NOT_A_PEER, 0);
	return TC_ACT_SHOT;
}

/* A packet decapsulated and decided at the underlay device that it handed to the tunnel device
 * for the stack (the HTTP proxy's, by its mark): judged once, not again here. A global
 * function, as ciliate_tunnel_decap4. */
__attribute__((noinline)) int ciliate_tunnel_decided(struct __sk_buff *skb)
{
	__u32 zero = 0;
	struct tunnel_config *t = bpf_map_lookup_elem(&tunnel_config, &zero);
	if (!t || !t->ifindex || skb->ifindex != t->ifindex)
		return 0;
	struct l7_proxy_config *c = l7_config();
	return c && c->local_mark && skb->mark == c->local_mark;
}

/* The outer headers of a VXLAN packet over IPv4, from the outer IP header on. */
struct tunnel_outer4 {
	struct iphdr ip;
	struct udphdr udp;
	struct vxlan_header vx;
	struct ethhdr eth;
}; /* 50 bytes, then 2 of padding */

/* Tunnel mode, send side: BPF host routing found the next hop of an allowed IPv4 pod packet on
 * the tunnel device (*f: the peer node's address as gateway, its VTEP MAC, the device's own).
 * The packet is encapsulated here as the kernel's vxlan device would (the same outer headers:
 * from the node's address, UDP source port from the inner flow's hash, to CILIATE_TUNNEL_PORT,
 * ciliate's VNI, no outer UDP checksum, DF) and sent out of the device the FIB names for the
 * peer: no vxlan_xmit, no outer route lookup through the stack, no netfilter of the outer
 * packet. A GSO packet stays one (its segments keep their size: the pod's MTU already leaves
 * room for the headers). Returns the verdict; -1 when it is not the tunnel's or cannot be done
 * before the packet changed: the caller hands it to the tunnel device as before. */
__attribute__((noinline)) int ciliate_tunnel_encap4(struct __sk_buff *skb, const struct bpf_fib_lookup *f)
{
	if (!f)
		return -1;
	__u32 zero = 0;
	struct tunnel_config *t = bpf_map_lookup_elem(&tunnel_config, &zero);
	if (!t || !t->ifindex || t->ifindex != f->ifindex || !t->local4)
		return -1;
	__u32 local = t->local4, peer = f->ipv4_dst;
	/* Where the outer packet goes: the FIB's answer for the peer node. */
	struct bpf_fib_lookup o = {};
	o.family = AF_INET;
	o.l4_protocol = IPPROTO_UDP;
	o.ipv4_src = local;
	o.ipv4_dst = peer;
	o.ifindex = skb->ingress_ifindex; /* as host_route's lookup: forwarded from the pod's veth */
	if (bpf_fib_lookup(skb, &o, sizeof(o), 0) != BPF_FIB_LKUP_RET_SUCCESS ||
	    o.ifindex == f->ifindex)
		return -1;
	struct tunnel_outer4 h = {};
	__u32 hash = bpf_get_hash_recalc(skb);
	__u32 len = skb->len - ETH_HLEN + TUNNEL_OUTER4_LEN;
	h.ip.version = 4;
	h.ip.ihl = 5;
	h.ip.frag_off = bpf_htons(0x4000); /* DF */
	h.ip.ttl = 64;
	h.ip.protocol = IPPROTO_UDP;
	h.ip.saddr = local;
	h.ip.daddr = peer;
	/* A GSO packet may be longer than an IP length can say (segmentation writes each
	 * segment's): 0 then, as the stack's own. */
	h.ip.tot_len = len <= 0xffff ? bpf_htons(len) : 0;
	__u32 sum = 0;
	__u16 *w = (__u16 *)&h.ip;
#pragma unroll
	for (int i = 0; i < 10; i++)
		sum += w[i];
	sum = (sum & 0xffff) + (sum >> 16);
	sum = (sum & 0xffff) + (sum >> 16);
	h.ip.check = ~sum;
	/* The kernel's range for tunnel source ports (udp_flow_src_port): 32768..60999. */
	h.udp.source = bpf_htons(32768 + (__u16)(((__u64)hash * (61000 - 32768)) >> 32));
	h.udp.dest = bpf_htons(CILIATE_TUNNEL_PORT);
	h.udp.len = len - sizeof(struct iphdr) <= 0xffff ? bpf_htons(len - sizeof(struct iphdr)) : 0;
	h.vx.flags = 0x08;
	h.vx.vni[2] = CILIATE_TUNNEL_VNI;
	__builtin_memcpy(h.eth.h_dest, f->dmac, 6);
	__builtin_memcpy(h.eth.h_source, f->smac, 6);
	h.eth.h_proto = bpf_htons(ETH_P_IP);
	__u64 flags = BPF_F_ADJ_ROOM_FIXED_GSO | BPF_F_ADJ_ROOM_ENCAP_L3_IPV4 |
		      BPF_F_ADJ_ROOM_ENCAP_L4_UDP | BPF_F_ADJ_ROOM_ENCAP_L2_ETH |
		      BPF_F_ADJ_ROOM_ENCAP_L2(ETH_HLEN);
	if (bpf_skb_adjust_room(skb, TUNNEL_OUTER4_LEN, BPF_ADJ_ROOM_MAC, flags) < 0)
		return -1;
	/* From here on the packet has changed: a failure drops it. */
	if (bpf_skb_store_bytes(skb, ETH_HLEN, &h, TUNNEL_OUTER4_LEN, BPF_F_INVALIDATE_HASH) < 0 ||
	    bpf_skb_store_bytes(skb, 0, o.dmac, 6, 0) < 0 ||
	    bpf_skb_store_bytes(skb, 6, o.smac, 6, 0) < 0)
		return TC_ACT_SHOT;
	bump(&tunnel_encapped);
	return bpf_redirect(o.ifindex, 0);
}

#endif /* CILIATE_LIB_TUNNEL_H */
