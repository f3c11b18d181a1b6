//! The runs page (`/ui/`): a run history table and a run's detail view, plain HTML and a little
//! JavaScript embedded in the binary (no build step, no CDN, nothing fetched from elsewhere).
//!
//! Authentication: the page's files hold no data, so they are served to anyone who can reach
//! clawmux, like `/healthz`. Everything the page shows it fetches from `/v1/*` with the same
//! `Authorization: Bearer <token>` header every API client sends: the page asks for the token
//! (an API key or the admin token), keeps it in the tab's `sessionStorage` (gone when the tab
//! closes; never in a URL, a cookie or `localStorage`), and sends it from JavaScript, so `/v1/*`
//! applies exactly its own rules (an API key sees only its accounts' runs). Without
//! `CLAWMUX_API_TOKEN`, a loopback browser needs no token while no API key exists (`clawmux demo`),
//! as for `curl`. The live output is read with `fetch` (not `EventSource`, which cannot send the
//! header), resuming with `Last-Event-ID` after a dropped connection.
//!
//! The page never puts data into HTML: every value goes through `textContent` or an attribute
//! set from code, and links are only made from `http(s)` URLs. The Content-Security-Policy
//! below forbids inline scripts and any other origin as a second wall.

use actix_web::http::header;
use actix_web::{web, HttpResponse};

/// One embedded file.
struct Asset {
    /// Its path under `/ui/`.
    path: &'static str,
    /// `Content-Type`.
    content_type: &'static str,
    /// The file.
    body: &'static str,
}

const ASSETS: &[Asset] = &[
    Asset { path: "/ui/", content_type: "text/html; charset=utf-8", body: include_str!("assets/runs.html") },
    Asset { path: "/ui/run", content_type: "text/html; charset=utf-8", body: include_str!("assets/run.html") },
    Asset { path: "/ui/common.js", content_type: "text/javascript; charset=utf-8", body: include_str!("assets/common.js") },
    Asset { path: "/ui/runs.js", content_type: "text/javascript; charset=utf-8", body: include_str!("assets/runs.js") },
    Asset { path: "/ui/run.js", content_type: "text/javascript; charset=utf-8", body: include_str!("assets/run.js") },
    Asset { path: "/ui/style.css", content_type: "text/css; charset=utf-8", body: include_str!("assets/style.css") },
];

/// Scripts and styles from this origin only, no inline script, no plugins, no framing; the only
/// images are inline SVG/data (none today); `connect-src 'self'`: the page talks to this clawmux
/// and nothing else.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; \
base-uri 'none'; form-action 'self'; frame-ancestors 'none'";

/// Wires `/ui`, `/ui/` and the assets.
pub fn routes(cfg: &mut web::ServiceConfig) {
    cfg.route("/ui", web::get().to(|| async { HttpResponse::PermanentRedirect().insert_header((header::LOCATION, "/ui/")).finish() }));
    for asset in ASSETS {
        cfg.route(asset.path, web::get().to(move || async move { serve(asset) }));
    }
}

fn serve(asset: &Asset) -> HttpResponse {
    HttpResponse::Ok()
        .content_type(asset.content_type)
        .insert_header((header::CONTENT_SECURITY_POLICY, CSP))
        .insert_header((header::X_CONTENT_TYPE_OPTIONS, "nosniff"))
        .insert_header((header::REFERRER_POLICY, "no-referrer"))
        .insert_header((header::X_FRAME_OPTIONS, "DENY"))
        // The files change with the binary: always revalidate (they are small).
        .insert_header((header::CACHE_CONTROL, "no-cache"))
        .body(asset.body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_load_only_their_own_scripts_and_no_inline_code() {
        for a in ASSETS.iter().filter(|a| a.content_type.starts_with("text/html")) {
            let scripts: Vec<&str> = a.body.match_indices("<script").map(|(i, _)| &a.body[i..]).collect();
            assert!(!scripts.is_empty(), "{} loads its script", a.path);
            for s in scripts {
                let tag = &s[..s.find('>').unwrap_or(s.len())];
                assert!(tag.contains("src=\"/ui/"), "{}: only same-origin script files, no inline script: {tag}", a.path);
            }
            assert!(!has_inline_handler(a.body), "{}: no inline event handlers", a.path);
            assert!(!a.body.contains("http://") && !a.body.contains("https://"), "{}: nothing from elsewhere", a.path);
        }
    }

    fn has_inline_handler(html: &str) -> bool {
        html.split('<').any(|tag| tag.split_whitespace().skip(1).any(|attr| attr.starts_with("on") && attr.contains('=')))
    }

    #[test]
    fn scripts_never_write_html() {
        for a in ASSETS.iter().filter(|a| a.path.ends_with(".js")) {
            for sink in ["innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"] {
                assert!(!a.body.contains(sink), "{} uses {sink}", a.path);
            }
        }
    }
}
