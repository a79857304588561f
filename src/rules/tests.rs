use super::*;
use std::fmt::Write as _;

const RESTATE: &str = r#"
rules:
  - id: glm-quota
    provider: glm
    from_statuses: [403]
    to_status: 429
    text_markers: ["用户额度不足", "额度不足"]
    exclude_markers: ["无权访问模型"]
  - id: any-503
    provider: "*"
    from_statuses: [500, 503]
    to_status: 429
    text_markers: ["Rate Limited"]
    retry_after_s: 5
"#;

fn restate_set() -> RuleSet {
    RuleSet::from_texts(Some(("restatement.yaml", RESTATE)), None).unwrap()
}

fn problems(restatement: Option<&str>, classification: Option<&str>) -> Vec<String> {
    RuleSet::from_texts(
        restatement.map(|t| ("r.yaml", t)),
        classification.map(|t| ("c.yaml", t)),
    )
    .unwrap_err()
    .iter()
    .map(ToString::to_string)
    .collect()
}

#[test]
fn restatement_fires_with_defaults() {
    let set = restate_set();
    assert_eq!(set.restatement_count(), 2);
    assert_eq!(set.classification_count(), 0);
    let body = r#"{"error":{"message":"用户额度不足,请充值"}}"#.as_bytes();
    assert_eq!(
        set.restate("glm", 403, body),
        Some(Restated {
            rule: "glm-quota".into(),
            to_status: 429,
            retry_after_s: 60,
        })
    );
    let r = set
        .restate("anything", 503, b"upstream rate limited")
        .unwrap();
    assert_eq!((r.rule.as_str(), r.retry_after_s), ("any-503", 5));
}

#[test]
fn restatement_exclusion_provider_and_status_mismatch() {
    let set = restate_set();
    let excluded = "额度不足 / 无权访问模型".as_bytes();
    assert_eq!(set.restate("glm", 403, excluded), None);
    assert_eq!(set.restate("openai", 403, "额度不足".as_bytes()), None);
    assert_eq!(set.restate("glm", 401, "额度不足".as_bytes()), None);
    assert_eq!(set.restate("glm", 403, b"forbidden"), None);
    assert_eq!(
        RuleSet::empty().restate("glm", 403, "额度不足".as_bytes()),
        None
    );
}

#[test]
fn missing_files_and_empty_lists_mean_no_rules() {
    for text in ["rules: []", "rules:"] {
        let set = RuleSet::from_texts(Some(("r", text)), Some(("c", text))).unwrap();
        assert_eq!(
            (set.restatement_count(), set.classification_count()),
            (0, 0)
        );
    }
    // What a truncating save leaves is an error, never "no rules" (SPEC §6).
    for text in ["", "# only a comment\n", "other: 1\n"] {
        let problems = RuleSet::from_texts(Some(("r.yaml", text)), None).unwrap_err();
        assert!(
            problems.iter().any(|p| p.file == "r.yaml"),
            "{text:?}: {problems:?}"
        );
    }
    let set = RuleSet::from_texts(None, None).unwrap();
    assert_eq!(set.restatement_count(), 0);
    let dir = std::env::temp_dir().join("sluice-rules-test-does-not-exist");
    assert_eq!(RuleSet::load_dir(&dir).unwrap().classification_count(), 0);
}

#[test]
fn classification_validation_reports_exact_paths() {
    let text = r#"
rules:
  - id: ok
    provider: "*"
    status: [429]
    reason: rate_limit_exceeded
    scope: connection
  - id: bad-reason
    provider: "*"
    status: [400, 600]
    reason: slow
    scope: planet
    terminal: gone
    cooldown_s: 0
    colour: red
  - id: ok
    provider: ""
    reason: banned
    scope: provider
    terminal: banned
  - id: " "
    provider: p
    match: ["", 3]
    header: "bad header="
    reason: timeout
    scope: request
    retryable: "yes"
  - "not a mapping"
  - id: x
    provider: p
    header: "x-a="
    reason: timeout
    scope: provider
    cooldown_s: 2592001
"#;
    let got = problems(None, Some(text));
    let want = [
        "c.yaml: rules[1].colour: unknown key; expected one of id, provider, status, match, header, reason, scope, cooldown_s, terminal, retryable",
        "c.yaml: rules[1].status[1]: 600 is not an HTTP status (expected 100..=599)",
        "c.yaml: rules[1].reason: unknown reason \"slow\"; expected one of rate_limit_exceeded, quota_exhausted, concurrency_limited, credits_exhausted, auth_error, banned, not_found, context_overflow, bad_request, server_error, timeout, transport",
        "c.yaml: rules[1].scope: unknown scope \"planet\"; expected provider, connection, model or request",
        "c.yaml: rules[1].terminal: unknown terminal state \"gone\"; expected banned, expired or credits_exhausted",
        "c.yaml: rules[1].cooldown_s: must be between 1 and 2592000 seconds (30 days)",
        "c.yaml: rules[2].id: duplicate rule id \"ok\"",
        "c.yaml: rules[2].provider: must not be empty; use \"*\" for every provider",
        "c.yaml: rules[2]: a rule needs at least one of status, match or header",
        "c.yaml: rules[2].terminal: a terminal state belongs to a connection: set scope: connection",
        "c.yaml: rules[3].id: must not be empty",
        "c.yaml: rules[3].match[0]: a marker must not be empty (it would match every body)",
        "c.yaml: rules[3].match[1]: invalid type: integer `3`, expected a string",
        "c.yaml: rules[3].header: \"bad header\" is not a valid header name",
        "c.yaml: rules[3].retryable: invalid type: string \"yes\", expected a boolean",
        "c.yaml: rules[4]: a rule must be a mapping",
        "c.yaml: rules[5].header: write \"name\" to test presence or \"name=value\" with a value",
        "c.yaml: rules[5].cooldown_s: must be between 1 and 2592000 seconds (30 days)",
    ];
    assert_eq!(got, want);
}

#[test]
fn restatement_validation_reports_exact_paths() {
    let text = r#"
rules:
  - id: a
    provider: "*"
    from_statuses: []
    to_status: 700
    text_markers: []
    retry_after_s: 0
  - id: a
    from_statuses: ["x"]
    text_markers: ["q"]
    exclude_markers: [""]
    weird: 1
"#;
    let got = problems(Some(text), None);
    let want = [
        "r.yaml: rules[0].from_statuses: must not be empty",
        "r.yaml: rules[0].to_status: 700 is not an HTTP status (expected 100..=599)",
        "r.yaml: rules[0].text_markers: must list at least one marker",
        "r.yaml: rules[0].retry_after_s: must be between 1 and 86400 seconds",
        "r.yaml: rules[1].weird: unknown key; expected one of id, provider, from_statuses, to_status, text_markers, exclude_markers, retry_after_s",
        "r.yaml: rules[1].id: duplicate rule id \"a\"",
        "r.yaml: rules[1].provider: is required",
        "r.yaml: rules[1].to_status: is required",
        "r.yaml: rules[1].exclude_markers[0]: a marker must not be empty (it would match every body)",
    ];
    for w in &want {
        assert!(got.iter().any(|g| g == w), "missing {w}\n got: {got:#?}");
    }
    assert!(
        got.iter()
            .any(|g| g.starts_with("r.yaml: rules[1].from_statuses[0]: invalid type")),
        "{got:#?}"
    );
    assert_eq!(got.len(), want.len() + 1, "{got:#?}");
}

#[test]
fn document_shape_problems() {
    assert_eq!(
        problems(None, Some("- a\n")),
        ["c.yaml: the top level must be a mapping with a `rules:` list"]
    );
    assert_eq!(
        problems(None, Some("rules: {}\nextra: 1\n")),
        [
            "c.yaml: extra: unknown key; expected rules",
            "c.yaml: rules: must be a list"
        ]
    );
    let bad = problems(Some("rules: [\n"), None);
    assert_eq!(bad.len(), 1);
    assert!(bad[0].starts_with("r.yaml: not valid YAML"), "{bad:?}");
}

#[test]
fn both_files_report_together() {
    let got = problems(
        Some("rules: [{id: a}]"),
        Some("rules: [{id: b, provider: p, status: [400]}]"),
    );
    assert!(got.iter().any(|g| g.starts_with("r.yaml: rules[0]")));
    assert!(got
        .iter()
        .any(|g| g == "c.yaml: rules[0].reason: is required"));
    assert!(got
        .iter()
        .any(|g| g == "c.yaml: rules[0].scope: is required"));
}

fn many(n: usize, restatement: bool) -> String {
    let mut s = String::from("rules:\n");
    for i in 0..n {
        if restatement {
            let _ = writeln!(
                s,
                "  - {{id: r{i}, provider: p, from_statuses: [403], to_status: 429, text_markers: [q]}}"
            );
        } else {
            let _ = writeln!(
                s,
                "  - {{id: r{i}, provider: p, status: [400], reason: bad_request, scope: request}}"
            );
        }
    }
    s
}

#[test]
fn at_most_500_rules_per_file() {
    let ok = RuleSet::from_texts(
        Some(("r", &many(MAX_RULES, true))),
        Some(("c", &many(MAX_RULES, false))),
    )
    .unwrap();
    assert_eq!(ok.restatement_count(), 500);
    assert_eq!(ok.classification_count(), 500);
    assert_eq!(
        problems(None, Some(&many(501, false))),
        ["c.yaml: rules: at most 500 rules are allowed, found 501"]
    );
    assert_eq!(
        problems(Some(&many(501, true)), None),
        ["r.yaml: rules: at most 500 rules are allowed, found 501"]
    );
}

#[test]
fn classification_conditions_all_must_hold() {
    let text = r#"
rules:
  - id: both
    provider: p
    status: [403]
    match: ["Blocked"]
    header: "x-kind"
    reason: banned
    scope: connection
    terminal: banned
    retryable: true
"#;
    let set = RuleSet::from_texts(None, Some(("c", text))).unwrap();
    let mut h = HeaderMap::new();
    h.insert("x-kind", "anything".parse().unwrap());
    let hit = |p: &str, s: u16, h: Option<&HeaderMap>, b: &[u8]| {
        set.classification_rule(p, s, h, &Haystack::new(b))
            .map(|r| r.id().to_string())
    };
    assert_eq!(
        hit("p", 403, Some(&h), b"you are BLOCKED"),
        Some("both".into())
    );
    assert_eq!(hit("q", 403, Some(&h), b"blocked"), None);
    assert_eq!(hit("p", 401, Some(&h), b"blocked"), None);
    assert_eq!(hit("p", 403, None, b"blocked"), None);
    assert_eq!(hit("p", 403, Some(&h), b"nope"), None);
    let c = set
        .classification_rule("p", 403, Some(&h), &Haystack::new(b"blocked"))
        .unwrap()
        .classification();
    assert!(c.retryable);
    assert_eq!(c.terminal, Some(TerminalState::Banned));
}

#[test]
fn header_value_match_ignores_case_and_whitespace() {
    let text = "rules: [{id: h, provider: '*', header: 'X-Error-Type = Ban', reason: banned, scope: connection}]";
    let set = RuleSet::from_texts(None, Some(("c", text))).unwrap();
    let mut h = HeaderMap::new();
    h.append("x-error-type", "other".parse().unwrap());
    h.append("x-error-type", " BAN ".parse().unwrap());
    let body = Haystack::new(b"");
    assert!(set.classification_rule("p", 403, Some(&h), &body).is_some());
    let mut h2 = HeaderMap::new();
    h2.insert("x-error-type", "banana".parse().unwrap());
    assert!(set
        .classification_rule("p", 403, Some(&h2), &body)
        .is_none());
}

#[test]
fn retryable_defaults() {
    let text = r#"
rules:
  - {id: a, provider: p, status: [400], reason: bad_request, scope: request}
  - {id: b, provider: p, status: [401], reason: auth_error, scope: connection}
  - {id: c, provider: p, status: [402], reason: credits_exhausted, scope: connection, terminal: credits_exhausted}
  - {id: d, provider: p, status: [418], reason: bad_request, scope: request, retryable: true}
"#;
    let set = RuleSet::from_texts(None, Some(("c", text))).unwrap();
    let body = Haystack::new(b"");
    let r = |s| {
        set.classification_rule("p", s, None, &body)
            .unwrap()
            .classification()
            .retryable
    };
    assert_eq!((r(400), r(401), r(402), r(418)), (false, true, false, true));
}

#[test]
fn shipped_rules_dir_loads() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("rules");
    let set = RuleSet::load_dir(&dir).unwrap_or_else(|p| panic!("{p:#?}"));
    assert!(set.restatement_count() >= 1);
    assert!(set.classification_count() >= 2);
    let r = set
        .restate("glm", 403, "{\"msg\":\"用户额度不足\"}".as_bytes())
        .unwrap();
    assert_eq!((r.to_status, r.retry_after_s), (429, 60));
    assert_eq!(
        set.restate("glm", 403, "额度不足 无权访问模型".as_bytes()),
        None
    );
}

#[test]
fn load_dir_reports_file_names() {
    let dir = std::env::temp_dir().join(format!("sluice-rules-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join(CLASSIFICATION_FILE), "rules: [{id: a}]").unwrap();
    let got = RuleSet::load_dir(&dir).unwrap_err();
    let file = dir.join(CLASSIFICATION_FILE).display().to_string();
    assert!(got.iter().all(|p| p.file == file), "{got:#?}");
    assert!(got.iter().any(|p| p.path == "rules[0].provider"));
    std::fs::remove_dir_all(&dir).unwrap();
}
