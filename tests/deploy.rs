//! The operator kit in `deploy/` holds together: the Kubernetes manifest's config and
//! rules pass `sluice check`, its probes and grace period fit the gateway's drain, every
//! secret the config names is in the Secret, the systemd unit's reload is the
//! zero-downtime upgrade of SPEC §8.1, and every metric and label the Grafana dashboard
//! and the Prometheus alert rules use is one a running gateway exports.

// Integration tests: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::gw::TempDir;
use serde_yaml::Value;
use std::path::Path;
use std::time::Duration;

fn manifest() -> Vec<Value> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/kubernetes/sluice.yaml");
    let text = std::fs::read_to_string(&path).unwrap();
    serde_yaml::Deserializer::from_str(&text)
        .map(|d| serde::Deserialize::deserialize(d).expect("each document is YAML"))
        .collect()
}

fn object<'a>(docs: &'a [Value], kind: &str) -> &'a Value {
    docs.iter()
        .find(|d| d["kind"] == kind)
        .unwrap_or_else(|| panic!("no {kind} in the manifest"))
}

fn config_text(docs: &[Value]) -> String {
    object(docs, "ConfigMap")["data"]["sluice.yaml"]
        .as_str()
        .unwrap()
        .to_owned()
}

fn config(docs: &[Value]) -> Value {
    serde_yaml::from_str(&config_text(docs)).unwrap()
}

/// Every `*_env` value in the config (the names of the secrets it reads).
fn env_names(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::Mapping(m) => {
            for (k, v) in m {
                match (k.as_str(), v.as_str()) {
                    (Some(k), Some(name)) if k.ends_with("_env") => out.push(name.to_owned()),
                    _ => env_names(v, out),
                }
            }
        }
        Value::Sequence(items) => items.iter().for_each(|i| env_names(i, out)),
        _ => {}
    }
}

#[test]
fn the_kubernetes_config_and_rules_pass_sluice_check() {
    let docs = manifest();
    let data = &object(&docs, "ConfigMap")["data"];
    let dir = TempDir::new("sluice-deploy");
    let rules = dir.0.join("rules");
    std::fs::create_dir_all(&rules).unwrap();
    for name in ["restatement.yaml", "classification.yaml"] {
        std::fs::write(rules.join(name), data[name].as_str().unwrap()).unwrap();
    }
    let text = config_text(&docs)
        .replace("/etc/sluice/rules", rules.to_str().unwrap())
        .replace("/var/lib/sluice", dir.0.to_str().unwrap());
    let path = dir.0.join("sluice.yaml");
    std::fs::write(&path, text).unwrap();
    let mut names = Vec::new();
    env_names(&config(&docs), &mut names);
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["check", "--config", path.to_str().unwrap()])
        .envs(names.iter().map(|n| (n.as_str(), "example")))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "sluice check failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn every_secret_the_kubernetes_config_reads_is_in_the_secret() {
    let docs = manifest();
    let mut names = Vec::new();
    env_names(&config(&docs), &mut names);
    assert!(names.contains(&"SLUICE_ADMIN_TOKEN".to_owned()));
    let secret = &object(&docs, "Secret")["stringData"];
    for n in &names {
        assert!(secret.get(n).is_some(), "the Secret has no {n}");
    }
    let container = &object(&docs, "Deployment")["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(
        container["envFrom"][0]["secretRef"]["name"],
        object(&docs, "Secret")["metadata"]["name"]
    );
}

#[test]
fn the_kubernetes_pod_drains_within_its_grace_period_and_probes_the_admin_port() {
    let docs = manifest();
    let cfg = config(&docs);
    let pod = &object(&docs, "Deployment")["spec"]["template"]["spec"];
    let c = &pod["containers"][0];
    let drain =
        humantime::parse_duration(cfg["server"]["drain_timeout"].as_str().unwrap()).unwrap();
    let pre_stop = c["lifecycle"]["preStop"]["exec"]["command"][1]
        .as_str()
        .unwrap()
        .parse::<u64>()
        .unwrap();
    let grace = pod["terminationGracePeriodSeconds"].as_u64().unwrap();
    assert!(
        Duration::from_secs(grace) > drain + Duration::from_secs(pre_stop),
        "grace {grace}s ≤ preStop {pre_stop}s + drain {drain:?}: the kubelet would cut the drain"
    );
    let port_of = |name: &str| {
        c["ports"]
            .as_sequence()
            .unwrap()
            .iter()
            .find(|p| p["name"] == name)
            .and_then(|p| p["containerPort"].as_u64())
            .unwrap()
    };
    let admin: std::net::SocketAddr = cfg["server"]["admin_listen"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    let client: std::net::SocketAddr = cfg["server"]["listen"].as_str().unwrap().parse().unwrap();
    assert!(
        admin.ip().is_unspecified(),
        "the kubelet cannot probe {admin}"
    );
    assert_eq!(port_of("admin"), u64::from(admin.port()));
    assert_eq!(port_of("http"), u64::from(client.port()));
    assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/ready");
    assert_eq!(c["readinessProbe"]["httpGet"]["port"], "admin");
    assert_eq!(c["livenessProbe"]["httpGet"]["path"], "/health");
    assert_eq!(c["livenessProbe"]["httpGet"]["port"], "admin");
    // The config directory is mounted whole: a subPath mount never sees ConfigMap edits.
    for m in c["volumeMounts"].as_sequence().unwrap() {
        assert!(m.get("subPath").is_none(), "{m:?}");
    }
    let items = &pod["volumes"][0]["configMap"]["items"];
    let paths: Vec<&str> = items
        .as_sequence()
        .unwrap()
        .iter()
        .filter_map(|i| i["path"].as_str())
        .collect();
    let dir = c["volumeMounts"][0]["mountPath"].as_str().unwrap();
    assert!(paths.contains(&"sluice.yaml") && dir == "/etc/sluice");
    let rules_dir = cfg["rules_dir"].as_str().unwrap();
    assert!(paths.contains(&"rules/restatement.yaml") && rules_dir == "/etc/sluice/rules");
    let selector = &object(&docs, "Service")["spec"]["selector"];
    assert_eq!(
        selector,
        &object(&docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    );
    assert_eq!(
        object(&docs, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"],
        *selector
    );
}

#[test]
fn the_systemd_unit_reloads_by_upgrade_and_outlasts_the_drain() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/sluice.service");
    let unit = std::fs::read_to_string(path).unwrap();
    let value = |key: &str| -> Vec<&str> {
        unit.lines()
            .filter_map(|l| l.strip_prefix(key)?.strip_prefix('='))
            .collect()
    };
    assert_eq!(value("Type"), ["notify"]);
    assert_eq!(
        value("NotifyAccess"),
        ["all"],
        "the successor announces itself as MAINPID"
    );
    let reload = value("ExecReload").join("\n");
    assert!(
        reload.contains("run --upgrade") && reload.contains("-QUIT ${MAINPID}"),
        "{reload}"
    );
    let stop = value("TimeoutStopSec")[0];
    let stop = humantime::parse_duration(stop).unwrap();
    assert!(
        stop > Duration::from_secs(600),
        "TimeoutStopSec {stop:?} cuts the default 10 min drain"
    );
}

/// Every `sluice_*` metric name in `text`.
fn metric_names(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(i) = rest.find("sluice_") {
        let tail = &rest[i..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        out.push(tail[..end].to_owned());
        rest = &tail[end..];
    }
    out
}

/// The label names an expression groups or filters by: `by (a, b)` and `{a=…, b=~…}`.
fn label_names(expr: &str) -> Vec<String> {
    let mut out = Vec::new();
    for (open, close) in [("by (", ')'), ("{", '}')] {
        let mut rest = expr;
        while let Some(i) = rest.find(open) {
            let tail = &rest[i + open.len()..];
            let end = tail.find(close).unwrap_or(tail.len());
            for part in tail[..end].split(',') {
                let name: String = part
                    .trim()
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                // `{{ $labels.x }}` templates and `$__rate_interval` are not labels.
                if !name.is_empty() && !part.contains('$') {
                    out.push(name);
                }
            }
            rest = &tail[end..];
        }
    }
    out
}

/// The `expr` of every dashboard target and every alert rule.
fn kit_exprs() -> Vec<(String, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy");
    let dash: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root.join("grafana/sluice-dashboard.json")).unwrap(),
    )
    .expect("the dashboard is JSON");
    let mut out = Vec::new();
    for p in dash["panels"].as_array().unwrap() {
        let targets = p["targets"].as_array().unwrap();
        assert!(!targets.is_empty(), "panel {} has no query", p["title"]);
        for t in targets {
            out.push((
                format!("panel {}", p["title"]),
                t["expr"].as_str().unwrap().to_owned(),
            ));
        }
    }
    let rules: Value = serde_yaml::from_str(
        &std::fs::read_to_string(root.join("prometheus/alerts.yaml")).unwrap(),
    )
    .unwrap();
    for g in rules["groups"].as_sequence().unwrap() {
        for r in g["rules"].as_sequence().unwrap() {
            out.push((
                format!("alert {}", r["alert"].as_str().unwrap()),
                r["expr"].as_str().unwrap().to_owned(),
            ));
        }
    }
    out
}

#[test]
fn the_dashboard_and_alerts_use_only_metrics_and_labels_the_gateway_exports() {
    let mock = common::Mock::start(&[]);
    let yaml = format!(
        "{}providers:\n  - id: p\n    base_url: \"{}\"\n    api: openai\n    connections:\n      - {{ id: c, api_key_env: KEY }}\nmodels:\n  - name: m\n    targets:\n      - {{ provider: p, model: up }}\n",
        common::gw::server_section(""),
        mock.base_url()
    );
    let gw = common::gw::Gateway::start(&yaml, &[("KEY", "k")]);
    assert_eq!(gw.chat(r#"{"model":"m","messages":[]}"#).status, 200);
    // A request is counted once its response is out: the scrape may come first.
    let mut scrape = String::new();
    common::wait_until(std::time::Duration::from_secs(5), || {
        scrape = common::request(gw.admin, "GET", "/metrics", &[], b"").text();
        scrape.contains("sluice_requests_total{")
    });
    // name → label names seen on its series (histograms: the family and its parts).
    let mut exported: std::collections::BTreeMap<String, std::collections::BTreeSet<String>> =
        Default::default();
    for line in scrape.lines().filter(|l| l.starts_with("sluice_")) {
        let name_end = line.find(['{', ' ']).unwrap();
        let name = &line[..name_end];
        let labels = exported.entry(name.to_owned()).or_default();
        if line[name_end..].starts_with('{') {
            let inner = &line[name_end + 1..line.find('}').unwrap()];
            for kv in inner.split(',') {
                if let Some((k, _)) = kv.split_once('=') {
                    labels.insert(k.to_owned());
                }
            }
        }
    }
    let exprs = kit_exprs();
    assert!(exprs.len() >= 15, "{} queries", exprs.len());
    for (what, expr) in &exprs {
        let names = metric_names(expr);
        assert!(!names.is_empty(), "{what}: no sluice metric in {expr}");
        let mut labels_here = std::collections::BTreeSet::new();
        for n in &names {
            let labels = exported
                .get(n)
                .unwrap_or_else(|| panic!("{what}: {n} is not exported by the gateway\n{scrape}"));
            labels_here.extend(labels.iter().cloned());
        }
        for l in label_names(expr) {
            assert!(
                labels_here.contains(&l),
                "{what}: no metric of {expr} has a label {l:?}"
            );
        }
    }
}
