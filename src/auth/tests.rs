use super::grants::Watched;
use super::tokens::Tokens;
use super::*;

const A: &str = "tok-aaaaaaaaaaaaaaaa";
const B: &str = "tok-bbbbbbbbbbbbbbbb";

#[test]
fn tokens_file_binds_tokens_to_tenants() {
    let t = Tokens::parse(&format!("# comment\n\n{A} *\n{B} alice \"\" # trailing\n")).unwrap();
    assert_eq!(t.len(), 2);
    assert_eq!(t.find(A.as_bytes()), Some(Scope::All));
    let b = t.find(B.as_bytes()).unwrap();
    assert!(b.allows("alice") && b.allows("") && !b.allows("bob"));
    assert_eq!(t.find(b"tok-aaaaaaaaaaaaaaab"), None);
    assert_eq!(t.find(b"tok-aaaaaaaaaaaaaaa"), None, "a prefix is not the token");
    assert_eq!(t.find(b""), None);
}

#[test]
fn bad_tokens_files_are_refused_without_echoing_the_token() {
    for (text, want) in [
        ("short *", "shorter than 16"),
        (&format!("{A}\n") as &str, "needs its tenants"),
        (&format!("{A} * alice"), "cannot be combined"),
        (&format!("{A} *\n{A} bob"), "line 2: the token appears twice"),
        ("tok-\u{e9}aaaaaaaaaaaaaaa *", "printable ASCII"),
    ] {
        let e = Tokens::parse(text).unwrap_err();
        assert!(e.message().contains(want), "{text:?}: {}", e.message());
        assert!(!e.message().contains("tok-"), "the token leaked into {:?}", e.message());
    }
}

#[test]
fn watched_file_follows_changes_and_keeps_the_last_good_version() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("tokens");
    std::fs::write(&p, format!("{A} *\n")).unwrap();
    let w = Watched::open(&p, Tokens::parse, std::time::Duration::ZERO).unwrap();
    assert!(w.current().find(A.as_bytes()).is_some());
    std::fs::write(&p, format!("{B} alice\n")).unwrap();
    assert!(w.current().find(A.as_bytes()).is_none(), "the old token is revoked");
    assert!(w.current().find(B.as_bytes()).is_some());
    std::fs::write(&p, "garbage\n").unwrap();
    assert!(w.current().find(B.as_bytes()).is_some(), "a broken file keeps the last good tokens");
    std::fs::write(&p, "").unwrap();
    assert!(w.current().is_empty(), "an empty file revokes every token");
}

#[test]
fn config_combinations_are_checked() {
    let tls = TlsConfig::default();
    assert!(AuthConfig { socket_requires_token: true, ..Default::default() }.validate(&tls).is_err());
    let half = TlsConfig { cert: "c.pem".into(), ..Default::default() };
    assert!(AuthConfig::default().validate(&half).is_err());
    let ca_only = TlsConfig { client_ca: "ca.pem".into(), ..Default::default() };
    assert!(AuthConfig::default().validate(&ca_only).is_err());
}

#[test]
fn only_loopback_tcp_goes_without_credentials() {
    let open = ServerAuth::from_config(&AuthConfig::default(), &TlsConfig::default()).unwrap();
    for a in ["127.0.0.1:1", "[::1]:1", "[::ffff:127.0.0.1]:1"] {
        open.check_tcp_exposure(a.parse().unwrap()).unwrap();
    }
    for a in ["0.0.0.0:1", "[::]:1", "10.1.2.3:1"] {
        let e = open.check_tcp_exposure(a.parse().unwrap()).unwrap_err();
        assert!(e.message().contains("--insecure-tcp"), "{}", e.message());
    }
    let insecure =
        ServerAuth::from_config(&AuthConfig { insecure_tcp: true, ..Default::default() }, &TlsConfig::default());
    insecure.unwrap().check_tcp_exposure("0.0.0.0:1".parse().unwrap()).unwrap();
}

#[test]
fn peer_allow_list() {
    let me = PeerCred { uid: 1000, gid: 100, pid: Some(1) };
    assert!(PeerAllowList::default().allows(None));
    assert!(PeerAllowList::new(&[1000], &[]).allows(Some(me)));
    assert!(PeerAllowList::new(&[], &[100]).allows(Some(me)));
    assert!(!PeerAllowList::new(&[0], &[0]).allows(Some(me)));
    assert!(!PeerAllowList::new(&[1000], &[]).allows(None), "an unknown peer is not on a list");
}

#[test]
fn certificate_names_bind_to_tenants() {
    let c = CertTenants::parse("# who\nops *\nteam-a a \"\"  # two tenants\n").unwrap();
    let cert = |cn: &str| {
        let mut p = rcgen::CertificateParams::new(vec!["client.test".to_string()]).unwrap();
        p.distinguished_name.push(rcgen::DnType::CommonName, cn);
        p.self_signed(&rcgen::KeyPair::generate().unwrap()).unwrap().der().to_vec()
    };
    assert_eq!(subject_cn(&cert("team-a")).as_deref(), Some("team-a"));
    assert_eq!(c.scope_of(&cert("ops")).unwrap(), Scope::All);
    assert_eq!(c.scope_of(&cert("team-a")).unwrap(), Scope::tenants(["a", ""]));
    assert!(c.scope_of(&cert("team-b")).unwrap_err().contains("CN=\"team-b\" is bound to no tenant"));
    assert!(c.scope_of(b"not a certificate").unwrap_err().contains("no readable subject CN"));
    for (text, why) in
        [("ops\n", "needs its tenants"), ("ops * a\n", "cannot be combined"), ("ops *\nops a\n", "appears twice")]
    {
        let e = CertTenants::parse(text).unwrap_err();
        assert!(e.message().contains(why) && e.message().contains("line"), "{text:?}: {}", e.message());
    }
    let tls = TlsConfig { client_tenants_file: "/x".into(), ..Default::default() };
    let e = AuthConfig::default().validate(&tls).unwrap_err();
    assert!(e.message().contains("needs tls.client_ca"), "{}", e.message());
}
