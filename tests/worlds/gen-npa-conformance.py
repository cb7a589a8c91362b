"""Worlds from the upstream network-policy-api conformance suite (a tag), with its mutations.

Usage (from the repository's root, after `cargo build`):
    NPA_REPO=/path/to/network-policy-api/.git python3 tests/worlds/gen-npa-conformance.py \
        v0.2.0 tests/worlds target/debug/ciliate admin-network-policy-standard-egress-tcp-rules.go ...
It writes npa-<tag>-<test>-<state>.yaml and its .expected.jsonl (ciliate's own output) and
prints every probe whose verdict differs from the suite's expectation: there must be none.

Each Go test is walked statement by statement: policy fetches, DeepCopy, rule copies and
swaps, priority and action edits and patches are applied to the manifests; every PokeServer
expectation is a probe of the world holding the policies as they are at that point. A new
world begins at every patch. A statement this walker does not know ends the test there
(reported)."""
import copy, json, re, subprocess, sys
import yaml

import os
REPO = os.environ["NPA_REPO"]
TAG = sys.argv[1]
OUT = sys.argv[2]            # directory for the worlds
CILIATE = sys.argv[3]        # the ciliate binary
TESTS = sys.argv[4:]         # go files (without directory)

def show(path):
    return subprocess.run(["git", "--git-dir", REPO, "show", f"{TAG}:{path}"],
                          capture_output=True, text=True, check=True).stdout

HDR = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "npa-anp-egress-cidr-pod-ips.yaml")).read().split("\npolicies:")[0].split("\n", 1)[1]

FIELD = {"Egress": "egress", "Ingress": "ingress"}
POD_IP = {}
for _p in yaml.safe_load(HDR)["pods"]:
    POD_IP[(_p["namespace"], _p["name"])] = _p["ips"][0]

def path_get(doc, path):
    # path like Spec.Egress[3] or Spec.Ingress[0].Action
    cur = doc
    for part in path.split("."):
        m = re.fullmatch(r"(\w+)(?:\[(\d+)\])?", part)
        key = m.group(1)
        key = key[0].lower() + key[1:]
        cur = cur[key]
        if m.group(2) is not None:
            cur = cur[int(m.group(2))]
    return cur

def path_set(doc, path, value):
    parts = path.split(".")
    cur = path_get(doc, ".".join(parts[:-1])) if len(parts) > 1 else doc
    m = re.fullmatch(r"(\w+)(?:\[(\d+)\])?", parts[-1])
    key = m.group(1)
    key = key[0].lower() + key[1:]
    if m.group(2) is not None:
        cur[key][int(m.group(2))] = value
    else:
        cur[key] = value

ACTIONS = {"Pass": "Pass", "Deny": "Deny", "Accept": "Accept", "Allow": "Allow"}

def walk(go, manifests):
    """Yields (state_index, policies, probe) and notes."""
    policies = {}
    for text in manifests:
        for d in yaml.safe_load_all(text):
            if d:
                policies[d["metadata"]["name"]] = d
    state = 0
    worlds = [copy.deepcopy(policies)]
    probes = [[]]
    notes = []
    vars_ = {}
    servers = {}
    pod_vars = set()
    last_name = None
    literal = None
    named = None
    strings = {}
    cnp_name = None
    mutate = None
    # One statement per line: a call split over lines is joined.
    stmts, acc, depth = [], "", 0
    for l in go.splitlines():
        l = l.strip()
        if l.startswith("//") and not acc:
            continue
        if not acc and not re.match(r'(\w+ :?= )?(kubernetes\.|s\.Client\.Get\()', l):
            stmts.append(l); continue
        acc = (acc + " " + l).strip() if acc else l
        depth += l.count("(") - l.count(")")
        if depth <= 0:
            stmts.append(acc); acc, depth = "", 0
    body = "\n".join(stmts)
    start = body.index("Test: func(")
    for line in body[start:].splitlines():
        if not line or line.startswith("//"):
            continue
        m = re.match(r'(\w+) :?= kubernetes\.GetPod\(t, s\.Client, "([^"]+)", "([^"]+)"', line)
        if m:
            servers[m.group(1)] = (m.group(2), m.group(3)); continue
        # v0.1.7: objects are fetched with s.Client.Get into a variable declared before.
        m = re.match(r'(\w+) :?= &v1\.Pod\{\}$', line)
        if m:
            pod_vars.add(m.group(1)); continue
        m = re.match(r'(\w+) :?= &(?:v1alpha1|networkingv1)\.\w+\{\}$', line)
        if m:
            continue
        m = re.match(r'err :?= s\.Client\.Get\(ctx, client\.ObjectKey\{\s*(?:Namespace:\s*"([^"]+)",\s*)?Name:\s*"([^"]+)",?\s*\}, (\w+)\)$', line)
        if m:
            if m.group(3) in pod_vars:
                servers[m.group(3)] = (m.group(1), m.group(2))
            else:
                cnp_name = m.group(2); last_name = m.group(2)
            continue
        if re.match(r'err :?= s\.Client\.Patch\(ctx, mutate, client\.MergeFrom\(\w+\)\)$', line):
            policies[cnp_name] = mutate
            worlds.append(copy.deepcopy(policies)); probes.append([])
            continue
        m = re.match(r'(\w+) := kubernetes\.Get(?:Cluster|Admin|BaselineAdmin)NetworkPolicy\(t, s\.Client, "([^"]+)"', line)
        if m:
            cnp_name = m.group(2); continue
        m = re.match(r'(?:\w+ :?= )?kubernetes\.PokeServer\(t, s\.ClientSet, &s\.KubeConfig, "([^"]+)", "([^"]+)", "(\w+)", (\w+)\.Status\.PodIP, int32\((\d+)\), s\.TimeoutConfig(?:\.RequestTimeout)?, (true|false)\)', line)
        if m:
            server = servers[m.group(4)]
            m2 = type("M", (), {"group": lambda self, i: m.group(i + 4)})()
            probes[-1].append(dict(frm=m.group(1) + "/" + m.group(2), to=server[0] + "/" + server[1],
                                   proto=m.group(3).upper(), port=int(m2.group(1)), ok=m2.group(2) == "true"))
            continue
        if "kubernetes.PokeServer(" in line:
            notes.append("unparsed poke: " + line); return worlds, probes, notes, False
        if re.match(r'mutate := \w+\.DeepCopy\(\)', line):
            mutate = copy.deepcopy(policies[cnp_name]); continue
        m = re.match(r'(\w+) := mutate(?:\.DeepCopy\(\))?\.((?:Spec)\.[\w\[\]\.]+)$', line)
        if m:
            vars_[m.group(1)] = copy.deepcopy(path_get(mutate, m.group(2))); continue
        m = re.match(r'mutate\.(Spec\.[\w\[\]\.]+) = mutate\.(Spec\.[\w\[\]\.]+)$', line)
        if m:
            path_set(mutate, m.group(1), copy.deepcopy(path_get(mutate, m.group(2)))); continue
        m = re.match(r'mutate\.(Spec\.[\w\[\]\.]+) = (\d+)$', line)
        if m:
            path_set(mutate, m.group(1), int(m.group(2))); continue
        m = re.match(r'mutate\.(Spec\.[\w\[\]\.]+\.Action) = \w+\.\w+RuleAction(\w+)$', line)
        if m:
            path_set(mutate, m.group(1), ACTIONS[m.group(2)]); continue
        m = re.match(r'mutate\.(Spec\.[\w\[\]\.]+) = (\w+)$', line)
        if m and m.group(2) in vars_:
            path_set(mutate, m.group(1), copy.deepcopy(vars_[m.group(2)])); continue
        m = re.match(r'Name:\s*"([^"]+)",?$', line)
        if m and literal is None:
            last_name = m.group(1); continue
        if re.match(r'err :?= s\.Client\.Delete\(ctx, \w+\)$', line):
            del policies[last_name]
            worlds.append(copy.deepcopy(policies)); probes.append([])
            continue
        if "s.Client." in line and "s.Client.Get(" not in line:
            notes.append("stopped at: " + line); return worlds, probes, notes, False
        if re.match(r'kubernetes\.Patch\w*NetworkPolicy\(t, s\.Client, \w+, mutate,', line):
            policies[cnp_name] = mutate
            worlds.append(copy.deepcopy(policies)); probes.append([])
            continue
        # A string variable (a port name).
        m = re.match(r'(\w+) := "([^"]*)"$', line)
        if m:
            strings[m.group(1)] = m.group(2); continue
        # A rule's ports rewritten as one named port: `r.Ports = &[]...Port{ {NamedPort: &v}, }`
        # (v1alpha1) or `r.Protocols = []...Protocol{ {DestinationNamedPort: v}, }` (v1alpha2).
        m = re.match(r'(\w+)\.(Ports|Protocols) = &?\[\]\w+\.\w+\{$', line)
        if m and m.group(1) in vars_:
            named = {"var": m.group(1), "field": m.group(2), "port": None}; continue
        if named is not None:
            m = re.match(r'(?:Destination)?NamedPort: &?(\w+),$', line)
            if m:
                named["port"] = strings[m.group(1)]; continue
            if line in ("{", "},"):
                continue
            if line == "}" and named["port"] is not None:
                rule = vars_[named["var"]]
                if named["field"] == "Ports":
                    rule["ports"] = [{"namedPort": named["port"]}]
                else:
                    rule["protocols"] = [{"destinationNamedPort": named["port"]}]
                named = None; continue
            notes.append("stopped in a named port literal at: " + line); return worlds, probes, notes, False
        # A new rule written out in the test: name, action and `Networks` of pod addresses.
        m = re.match(r'(\w+) := \[\]\w+\.(?:Cluster|Admin|BaselineAdmin)NetworkPolicy(Egress|Ingress)Rule\{$', line)
        if m:
            literal = {"var": m.group(1), "name": None, "action": None, "nets": []}; continue
        if literal is not None:
            m = re.match(r'Name:\s*"([^"]+)",$', line)
            if m:
                literal["name"] = m.group(1); continue
            m = re.match(r'Action:\s*"(\w+)",$', line)
            if m:
                literal["action"] = m.group(1); continue
            m = re.match(r'\w+\.CIDR\((\w+)\.Status\.PodIP \+ mask\),$', line)
            if m:
                literal["nets"].append(POD_IP[servers[m.group(1)]] + "/32"); continue
            if line in ("{", "},", "}") or re.match(r'(To: \[\]\w+\.\w+EgressPeer|Networks: \[\]\w+\.CIDR)\{$', line):
                if line == "}":
                    vars_[literal["var"]] = [{"name": literal["name"], "action": literal["action"], "to": [{"networks": literal["nets"]}]}]
                    literal = None
                continue
            notes.append("stopped in a rule literal at: " + line); return worlds, probes, notes, False
        m = re.match(r'mutate\.Spec\.(Egress|Ingress) = append\((\w+), mutate\.Spec\.(Egress|Ingress)\.\.\.\)$', line)
        if m and m.group(2) in vars_ and m.group(1) == m.group(3):
            key = FIELD[m.group(1)]
            mutate["spec"][key] = copy.deepcopy(vars_[m.group(2)]) + mutate["spec"][key]; continue
        if re.match(r'(require|assert)\.\w+\(|ctx, cancel := |defer cancel\(\)', line):
            continue
        if line in ("var mask string", 'mask = "/32"', 'mask = "/128"', "} else {", "}") or line.startswith("if net.IsIPv4String("):
            continue
        if line.startswith("mutate") or "Patch" in line or "Update(" in line or "append(" in line:
            notes.append("stopped at: " + line); return worlds, probes, notes, False
    return worlds, probes, notes, True

def tests():
    """(file, text, ShortName, several in the file) of every ConformanceTest asked for."""
    for gofile in TESTS:
        go = show("conformance/tests/" + gofile)
        chunks = re.split(r'\nvar \w+ = suite\.ConformanceTest\{', go)[1:] or [go]
        for chunk in chunks:
            yield gofile, chunk, re.search(r'ShortName:\s*"(\w+)"', chunk).group(1), len(chunks) > 1

def main():
    summary = []
    for gofile, go, short, several in tests():
        manifests = [show("conformance/" + m) for m in re.findall(r'Manifests:\s*\[\]string\{"([^"]+)"\}', go)]
        mpath = re.findall(r'Manifests:\s*\[\]string\{"([^"]+)"\}', go)
        if "centaur" in go:
            # A host-networked server (its address is its node's): the worlds of these tests
            # are written by hand (npa-*-egress-nodes.yaml).
            print(f"{gofile} {short}: skipped, a host-networked server (see npa-*-egress-nodes.yaml)")
            continue
        worlds, probes, notes, complete = walk(go, manifests)
        stem = gofile[:-3].replace("-rules", "").replace("-network-policy-standard", "")
        stem = stem.replace("-network-policy-experimental", "-experimental")
        stem = stem.replace("baseline-admin-", "baseline-")
        if several:
            # A file of several tests: one stem per test, the end of its ShortName.
            stem += "-" + re.sub(r"(?<!^)(?=[A-Z])", "-", re.sub(r"^.*(?:Egress|Ingress)", "", short)).lower()
        base = "npa-" + TAG.replace(".", "") + "-" + stem
        for i, (pols, ps) in enumerate(zip(worlds, probes)):
            if not ps:
                continue
            name = f"{base}-{i}"
            text = (f"# {short}, the upstream conformance suite ({TAG}, conformance/tests/{gofile}): "
                    + ("the manifests as applied" if i == 0 else f"after its change {i} (a policy patched or deleted, as the test does)")
                    + f"; every PokeServer expectation of that state is a probe.\n")
            text += HDR + "\npolicies:\n  # conformance/" + ", ".join(mpath) + f" ({TAG})" + ("" if i == 0 else f", after change {i}") + "\n"
            text += "".join("  " + l + "\n" for l in yaml.safe_dump(list(pols.values()), default_flow_style=None, sort_keys=False, width=200).splitlines())
            text += "probes:\n"
            for c in ps:
                text += "  - {from: %s, to: %s, protocol: %s, port: %d}\n" % (c["frm"], c["to"], c["proto"], c["port"])
            path = f"{OUT}/{name}.yaml"
            open(path, "w").write(text)
            r = subprocess.run([CILIATE, "policy", "simulate", "--world", path], capture_output=True, text=True)
            got = [json.loads(l) for l in r.stdout.splitlines() if l.strip()]
            bad = []
            if r.returncode != 0 or len(got) != len(ps):
                bad.append(f"exit {r.returncode}, {len(got)} lines for {len(ps)} probes: {r.stderr[:500]}")
            for c, g in zip(ps, got):
                want = "allow" if c["ok"] else "deny"
                if g["verdict"] != want:
                    bad.append(f"{c['frm']} -> {c['to']} {c['proto']}/{c['port']}: got {g['verdict']}, the suite wants {want}: {g['reason']}")
            open(f"{OUT}/{name}.expected.jsonl", "w").write(r.stdout)
            summary.append((name, len(ps), bad))
        print(f"{gofile}: {len(worlds)} states, complete={complete}", *notes, sep="\n  ")
    total = sum(n for _, n, _ in summary)
    mism = [(n, b) for n, _, bs in summary for b in bs]
    print(f"{len(summary)} worlds, {total} probes, {len(mism)} mismatches")
    for n, b in mism:
        print(" ", n, b)

main()
