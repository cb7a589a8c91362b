// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * The host firewall (Cilium's, `--enable-host-firewall`): the node is an endpoint of its own
 * (CILIATE_HOST_ENDPOINT_ID, identity host), whose policy map holds what the host policies
 * (CiliumClusterwideNetworkPolicy `nodeSelector`) allow. It is judged
 *
 * - at the node's device (from_netdev, to_netdev): packets for one of the node's addresses,
 *   and packets the node itself sends (host_firewall);
 * - on a local pod's veth, for connections between that pod and the node (host_drops, called
 *   by decide once the pod's own policy allowed the connection).
 *
 * Exemptions, as Cilium's: replies and established flows of allowed connections (the host
 * endpoint's own conntrack entries); the node's loopback (no program sees it); what pods send
 * that leaves with the node's address (masqueraded, or a tunnel's outer packet: the pod's
 * policy judged it, and it is tracked so its replies come back in); the tunnel between nodes
 * (UDP CILIATE_TUNNEL_PORT to and from node addresses: remote-node, or a tunnel peer of
 * any identity); IPv4 ICMP errors about a tracked connection; IPv6 neighbour discovery; TCP
 * packets other than a connection's opening SYN that belong to no tracked connection (they
 * cannot open one, and may belong to a connection made before the firewall was on).
 *
 * No host endpoint in the endpoint map: no host firewall, and every function here lets
 * everything through.
 */
#ifndef CILIATE_LIB_HOSTFW_H
#define CILIATE_LIB_HOSTFW_H

/* Tunnel mode: the IPv4 addresses of the nodes this node tunnels to (the FDB of its vxlan
 * device), written by the agent's route pass. Their tunnel packets are exempt whatever their
 * identity: a node of a class (cluster tiers' `nodes` peers) is no `remote-node`. */
PINNED_MAP(BPF_MAP_TYPE_HASH, CILIATE_TUNNEL_PEERS_MAX, __u32, __u8, BPF_F_NO_PREALLOC) tunnel_peers SEC(".maps");

/* Whether `addr` (IPv4, network order) is a tunnel peer. A global function: the verifier
 * checks it once, not along every path of the program through its call. */
__attribute__((noinline)) int ciliate_tunnel_peer4(__u32 addr)
{
	return bpf_map_lookup_elem(&tunnel_peers, &addr) != 0;
}

/* Whether the packet's peer (egress: its destination) is a tunnel peer. */
static __always_inline int tunnel_peer(struct packet *p, int egress)
{
	__u32 peer;
	__builtin_memcpy(&peer, egress ? p->daddr : p->saddr, 4);
	return p->family == 4 && ciliate_tunnel_peer4(peer);
}

/* The host endpoint's record, or 0 when the host firewall is off. */
static __always_inline struct endpoint_info *host_endpoint(void)
{
	__u32 ep = CILIATE_HOST_ENDPOINT_ID;
	struct endpoint_info *h = bpf_map_lookup_elem(&endpoints, &ep);
	return h && h->identity ? h : 0;
}

/* The host endpoint's verdict on a new connection with a peer of `identity` (counted and
 * reported as the host endpoint's). */
static __always_inline __u32 host_judge(struct endpoint_info *h, struct packet *p, __u32 identity,
					int egress, __u64 len)
{
	__u32 ep = CILIATE_HOST_ENDPOINT_ID, cookie = 0, reason;
	__u8 redirect;
	if (h->flags & CILIATE_EP_DROP_ALL)
		reason = CILIATE_DROP_NOT_REALIZED;
	else
		reason = judge(ep, h, identity, egress, p, len, &cookie, &redirect);
	count(reason);
	emit(p, ep, identity, egress, reason, cookie);
	return reason;
}

/* A new connection between a local pod (of identity pod_id) and this node, which the pod's
 * policy allowed: whether the host endpoint's policy drops it (host_egress: the node opens
 * it). */
static __always_inline int host_drops(struct packet *p, __u32 pod_id, int host_egress, __u64 len)
{
	struct endpoint_info *h = host_endpoint();
	if (!h)
		return 0;
	__u32 reason = host_judge(h, p, pod_id, host_egress, len);
	return dropped(reason) || reason == CILIATE_DROP_NOT_REALIZED;
}

/* Whether the packet's source (src) or destination is one of this node's addresses. */
static __always_inline int host_address(struct packet *p, int src)
{
	if (p->family == 4) {
		__u32 a;
		__builtin_memcpy(&a, src ? p->saddr : p->daddr, 4);
		return node_address4(a);
	}
	struct ipcache_host_key hk = {};
	hk.family = p->family;
	__builtin_memcpy(hk.addr, src ? p->saddr : p->daddr, 16);
	struct ipcache_value *v = bpf_map_lookup_elem(&ipcache_hosts, &hk);
	return v && v->identity == CILIATE_ID_HOST;
}

/* Tracks the packet's connection for the host endpoint (its replies pass). */
static __always_inline void host_track(struct packet *p, int egress, __u64 now, __u8 closing)
{
	struct ct_value nv = {};
	nv.last_seen_ns = now;
	nv.packets = 1;
	nv.egress = egress;
	nv.closing = closing;
	if (ct_create(p, CILIATE_HOST_ENDPOINT_ID, &nv))
		count(CILIATE_CT_FULL);
}

/* The host endpoint's entry of the packet's tuple (reverse = 0: the packet travels the way its
 * connection opened) or of its reply's (reverse = 1: it travels the other way), or 0. */
static __always_inline struct ct_value *host_ct(struct packet *p, int egress, int reverse)
{
	struct ct_value *ct = ct_lookup(p, CILIATE_HOST_ENDPOINT_ID, reverse);
	return ct && (ct->egress != egress) == reverse ? ct : 0;
}

/* A packet of a connection the host endpoint tracks: refreshed; 1 when found. Its entry is
 * the packet's own tuple (the direction that opened it) or the reversed one (a reply); the
 * reversed is tried first for a packet from a lower port to a higher one, the way a server
 * answers a client's ephemeral port, so that most packets of either direction cost one
 * lookup. Only the order depends on the ports: either finds the entry. */
static __always_inline int host_tracked(struct packet *p, int egress, __u64 now, __u8 closing)
{
	/* Each lookup with a constant direction: a variable one would put a branch in every
	 * field of the key, and the verifier would follow each. */
	struct ct_value *ct;
	int reply;
	if (p->sport < p->dport) {
		reply = 1;
		ct = host_ct(p, egress, 1);
		if (!ct) {
			reply = 0;
			ct = host_ct(p, egress, 0);
		}
	} else {
		reply = 0;
		ct = host_ct(p, egress, 0);
		if (!ct) {
			reply = 1;
			ct = host_ct(p, egress, 1);
		}
	}
	if (!ct)
		return 0;
	ct->last_seen_ns = now;
	if (reply && !ct->replied)
		ct->replied = 1;
	if (closing && !ct->closing)
		ct->closing = 1;
	__sync_fetch_and_add(&ct->packets, 1);
	count(reply ? CILIATE_ALLOW_REPLY : CILIATE_ALLOW_ESTABLISHED);
	return 1;
}

/* The host firewall at the node's device: TC_ACT_SHOT for what the host endpoint's policy
 * drops, TC_ACT_UNSPEC (the next program, or the stack) for everything else. */
static __always_inline int host_firewall(struct __sk_buff *skb, int egress)
{
	struct endpoint_info *h = host_endpoint();
	if (!h)
		return TC_ACT_UNSPEC;
	/* Ingress: frames for this host's MAC only (a bridge floods unknown unicast). */
	if (!egress && skb->pkt_type != 0 /* PACKET_HOST */)
		return TC_ACT_UNSPEC;
	struct packet p = {};
	/* Not IP, or malformed: the stack's to handle (it judges nothing into a socket). */
	if (parse(skb, &p) != 0)
		return TC_ACT_UNSPEC;
	if (p.protocol == IPPROTO_ICMPV6_ && !p.l4_missing &&
	    ((p.policy_port >= 130 && p.policy_port <= 137) || p.policy_port == 143))
		return TC_ACT_UNSPEC;
	if (!host_address(&p, egress))
		return TC_ACT_UNSPEC;
	__u64 now = bpf_ktime_get_coarse_ns();
	__u8 closing = p.protocol == IPPROTO_TCP && (p.tcp_flags & (TCP_FIN | TCP_RST));
	__u8 opening = p.protocol == IPPROTO_TCP && !p.l4_missing &&
		       (p.tcp_flags & (TCP_SYN | TCP_ACK)) == TCP_SYN;
	if (!opening && host_tracked(&p, egress, now, closing))
		return TC_ACT_UNSPEC;
	if (egress && (skb->mark & CILIATE_MARK_FROM_POD)) {
		host_track(&p, egress, now, closing);
		return TC_ACT_UNSPEC;
	}
	if (p.protocol == IPPROTO_TCP && !opening)
		return TC_ACT_UNSPEC;
	if (p.protocol == IPPROTO_ICMP && ciliate_related_icmp4(skb, CILIATE_HOST_ENDPOINT_ID)) {
		count(CILIATE_ALLOW_REPLY);
		return TC_ACT_UNSPEC;
	}
	__u32 identity = peer_identity(&p, egress);
	if (p.protocol == IPPROTO_UDP && p.dport == CILIATE_TUNNEL_PORT &&
	    (identity == CILIATE_ID_REMOTE_NODE || identity == CILIATE_ID_HOST ||
	     tunnel_peer(&p, egress)))
		return TC_ACT_UNSPEC;
	__u32 reason = host_judge(h, &p, identity, egress, skb->len);
	if (dropped(reason) || reason == CILIATE_DROP_NOT_REALIZED)
		return TC_ACT_SHOT;
	host_track(&p, egress, now, closing);
	return TC_ACT_UNSPEC;
}

#endif /* CILIATE_LIB_HOSTFW_H */
