//! The mock's Claude subscription account (SPEC §5.13's wire contract), so the demo and
//! the tests can drive every branch of the lane without a real account.
//!
//! Off until `POST /__subscription` arms it with a JSON plan (see [`Plan`]); then
//! `POST /v1/messages` (of the plan's `credential`, when it names one) answers as an
//! account at its 5-hour wall: a request without
//! `anthropic-usage-limit: slow` gets the wall 429 (`…-unified-status: rejected`, the
//! reset, the offer when the plan has one); a slow request gets the next step of the
//! plan's `slow` script (`active`, `slot_busy`, `overloaded` for a 529, or an ending
//! status), the last step repeating. `GET /api/oauth/usage` and `POST
//! /api/organizations/{uuid}/reset_rate_limits` answer the plan's `usage` and `claim`;
//! a claimed `reset` lifts the wall. Every such request is counted for `/__stats`.
//! Invariants: the plan is only read and changed under one short lock, and with no plan
//! the API routes behave exactly as before (the OAuth routes are 404).

use std::sync::Mutex;

use http::header::{HeaderName, HeaderValue};
use serde::Deserialize;
use serde_json::{json, Value};

use super::fault::Fault;

const SLOW_HEADER: &str = "anthropic-usage-limit";

/// What the armed account does. Every field is optional.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Plan {
    /// Only requests presenting this credential meet the account (all when absent).
    pub credential: Option<String>,
    /// The account is at its wall (a claimed reset lifts it).
    #[serde(default = "yes")]
    pub wall: bool,
    /// The wall offers the low-priority lane.
    #[serde(default = "yes")]
    pub offer: bool,
    /// Seconds from arming until the window resets (the `…-unified-reset` header, the
    /// same instant on every answer).
    #[serde(default = "hour")]
    pub reset_in: u64,
    /// Answers to slow requests, in order; the last one repeats.
    #[serde(default)]
    pub slow: Vec<String>,
    /// `…-slow-retry-after` on `slot_busy`, seconds.
    pub slow_retry_after: Option<f64>,
    /// `…-slow-max-wait` on `slot_busy`, seconds.
    pub slow_max_wait: Option<f64>,
    /// `…-overage-in-use: true` on every answer.
    #[serde(default)]
    pub overage: bool,
    /// The usage check: `reset` (claimable), `none`, or `fail` (a 500).
    #[serde(default = "reset_word")]
    pub usage: String,
    /// The claim's result: `reset`, `not_limited`, `already_used`, `not_offered`,
    /// or `fail` (a 500).
    #[serde(default = "reset_word")]
    pub claim: String,
    /// `next_available_at` of `already_used` / `not_offered`, seconds from now.
    pub next_available_in: Option<u64>,
}

fn yes() -> bool {
    true
}
fn hour() -> u64 {
    3600
}
fn reset_word() -> String {
    "reset".into()
}

#[derive(Default)]
struct Account {
    plan: Option<Plan>,
    /// When the window resets, unix seconds (fixed when armed).
    reset_at: u64,
    step: usize,
    walls: u64,
    slow_requests: u64,
    fast_requests: u64,
    usage_calls: u64,
    claim_calls: u64,
    last_usage_query: String,
    last_claim_org: String,
    last_claim_body: String,
    last_oauth_authorization: bool,
    last_oauth_beta: String,
}

/// The account, shared by the mock's connections.
#[derive(Default)]
pub struct Subscription {
    account: Mutex<Account>,
}

/// How the mock answers an OAuth route.
pub struct OAuthAnswer {
    pub status: u16,
    pub body: String,
}

fn now_s() -> u64 {
    crate::clock::unix_ms() / 1000
}

fn header(name: &str, value: String) -> Option<(HeaderName, HeaderValue)> {
    Some((
        HeaderName::from_bytes(name.as_bytes()).ok()?,
        HeaderValue::from_str(&value).ok()?,
    ))
}

impl Subscription {
    fn account(&self) -> std::sync::MutexGuard<'_, Account> {
        self.account.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Arms (or with `null`, disarms) the account; counters start again.
    pub fn set(&self, body: &[u8]) -> Result<(), String> {
        let plan: Option<Plan> = serde_json::from_slice(body)
            .map_err(|e| format!("subscription plan is not valid: {e}"))?;
        let reset_at = now_s() + plan.as_ref().map_or(0, |p| p.reset_in);
        *self.account() = Account {
            plan,
            reset_at,
            ..Account::default()
        };
        Ok(())
    }

    /// The answer to a `/v1/messages` request of an armed account, as a fault the
    /// normal answer path writes (a status with its headers, or headers on a success).
    pub fn on_message(&self, headers: &http::HeaderMap) -> Option<Fault> {
        let mut a = self.account();
        let plan = a.plan.clone()?;
        if plan
            .credential
            .as_deref()
            .is_some_and(|c| super::fault::request_credential(headers) != Some(c))
        {
            return None;
        }
        let slow = headers
            .get(SLOW_HEADER)
            .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"slow"));
        if slow {
            a.slow_requests += 1;
        } else {
            a.fast_requests += 1;
        }
        if !plan.wall {
            return None;
        }
        let reset = a.reset_at.to_string();
        let mut f = Fault::default();
        let mut add = |name: &str, value: String| {
            if let Some(h) = header(name, value) {
                f.headers.push(h);
            }
        };
        add("anthropic-ratelimit-unified-reset", reset);
        if plan.overage {
            add("anthropic-ratelimit-unified-overage-in-use", "true".into());
        }
        if !slow {
            a.walls += 1;
            add("anthropic-ratelimit-unified-status", "rejected".into());
            if plan.offer {
                add("anthropic-ratelimit-unified-slow-offer", "treatment".into());
            }
            f.status = Some(429);
            return Some(f);
        }
        let step = plan
            .slow
            .get(a.step)
            .or(plan.slow.last())
            .cloned()
            .unwrap_or_else(|| "active".into());
        a.step += 1;
        match step.as_str() {
            "active" | "not_needed" => {
                add("anthropic-ratelimit-unified-status", "allowed".into());
                add("anthropic-ratelimit-unified-slow-status", step);
            }
            "slot_busy" => {
                add("anthropic-ratelimit-unified-status", "rejected".into());
                add("anthropic-ratelimit-unified-slow-status", step);
                if let Some(s) = plan.slow_retry_after {
                    add(
                        "anthropic-ratelimit-unified-slow-retry-after",
                        s.to_string(),
                    );
                }
                if let Some(s) = plan.slow_max_wait {
                    add("anthropic-ratelimit-unified-slow-max-wait", s.to_string());
                }
                f.status = Some(429);
            }
            "overloaded" => f.status = Some(529),
            _ => {
                add("anthropic-ratelimit-unified-status", "rejected".into());
                add("anthropic-ratelimit-unified-slow-status", step);
                f.status = Some(429);
            }
        }
        Some(f)
    }

    /// `GET /api/oauth/usage` and `POST /api/organizations/{uuid}/reset_rate_limits`;
    /// `None` when the route is not one of them or no plan is armed.
    pub fn on_oauth(
        &self,
        method: &http::Method,
        path: &str,
        query: Option<&str>,
        headers: &http::HeaderMap,
        body: &[u8],
    ) -> Option<OAuthAnswer> {
        let mut a = self.account();
        let plan = a.plan.clone()?;
        let claim_org = path
            .strip_prefix("/api/organizations/")
            .and_then(|rest| rest.strip_suffix("/reset_rate_limits"));
        let is_usage = path == "/api/oauth/usage" && method == http::Method::GET;
        let is_claim = claim_org.is_some() && method == http::Method::POST;
        if !is_usage && !is_claim {
            return None;
        }
        a.last_oauth_authorization = headers
            .get("authorization")
            .is_some_and(|v| v.as_bytes().starts_with(b"Bearer "));
        a.last_oauth_beta = headers
            .get("anthropic-beta")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string();
        let next = now_s() + plan.next_available_in.unwrap_or(7 * 86_400);
        if is_usage {
            a.usage_calls += 1;
            a.last_usage_query = query.unwrap_or("").to_string();
            let block = match plan.usage.as_str() {
                "reset" => json!({"arm": "reset", "available": true}),
                "fail" => return Some(fail()),
                _ => json!({"arm": "none", "available": false, "next_available_at": next}),
            };
            let doc = json!({"five_hour": {"utilization": 100}, "juniper_tide": block});
            return Some(OAuthAnswer {
                status: 200,
                body: doc.to_string(),
            });
        }
        a.claim_calls += 1;
        a.last_claim_org = claim_org.unwrap_or("").to_string();
        a.last_claim_body = String::from_utf8_lossy(body).into_owned();
        let doc = match plan.claim.as_str() {
            "fail" => return Some(fail()),
            r @ ("reset" | "not_limited") => {
                if let Some(p) = a.plan.as_mut() {
                    p.wall = false;
                }
                json!({"result": r})
            }
            r => json!({"result": r, "next_available_at": next}),
        };
        Some(OAuthAnswer {
            status: 200,
            body: doc.to_string(),
        })
    }

    /// The `subscription` part of `/__stats`.
    pub fn to_json(&self) -> Value {
        let a = self.account();
        json!({
            "armed": a.plan.is_some(),
            "wall": a.plan.as_ref().is_some_and(|p| p.wall),
            "walls": a.walls,
            "slow_requests": a.slow_requests,
            "fast_requests": a.fast_requests,
            "usage_calls": a.usage_calls,
            "claim_calls": a.claim_calls,
            "last_usage_query": a.last_usage_query,
            "last_claim_org": a.last_claim_org,
            "last_claim_body": a.last_claim_body,
            "last_oauth_bearer": a.last_oauth_authorization,
            "last_oauth_beta": a.last_oauth_beta,
        })
    }
}

fn fail() -> OAuthAnswer {
    OAuthAnswer {
        status: 500,
        body: r#"{"type":"error","error":{"type":"api_error","message":"mock: usage service failed"}}"#
            .into(),
    }
}
