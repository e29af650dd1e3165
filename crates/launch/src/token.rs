//! The per-job secret a rendezvous client must show before its first request.

use crate::{err, LaunchError};
use std::io::Read;

/// A job's rendezvous secret: 32 to 128 hex digits, made fresh per launch
/// ([`Token::generate`]) and handed to the ranks in `MOEFUSE_RENDEZVOUS_TOKEN`. Another
/// local user who finds the port cannot read or pre-set keys without it. `Debug` never
/// prints it.
///
/// ```
/// let t = moefuse_launch::Token::generate()?;
/// assert_eq!(t.as_str().len(), 32);
/// assert_eq!(moefuse_launch::Token::parse(t.as_str())?, t);
/// assert!(moefuse_launch::Token::parse("short").is_err());
/// assert!(!format!("{t:?}").contains(t.as_str()));
/// # Ok::<(), moefuse_launch::LaunchError>(())
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct Token(String);

impl Token {
    /// 128 random bits from `/dev/urandom` (std's OS-seeded hasher keys where that file is
    /// missing), as 32 lowercase hex digits.
    pub fn generate() -> Result<Self, LaunchError> {
        let mut bytes = [0u8; 16];
        let from_os =
            std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut bytes));
        if from_os.is_err() {
            use std::hash::BuildHasher;
            // RandomState's keys come from the OS's random source; two of them, each hashing
            // the time, give 128 bits nobody else can predict.
            for (i, half) in bytes.chunks_mut(8).enumerate() {
                let state = std::collections::hash_map::RandomState::new();
                let h = state.hash_one((i, std::process::id(), std::time::SystemTime::now()));
                half.copy_from_slice(&h.to_le_bytes());
            }
        }
        Ok(Token(bytes.iter().map(|b| format!("{b:02x}")).collect()))
    }

    /// Checks a token's text: 32 to 128 hex digits.
    pub fn parse(text: &str) -> Result<Self, LaunchError> {
        let text = text.trim();
        if !(32..=128).contains(&text.len()) || !text.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(err(format!(
                "a rendezvous token is 32 to 128 hex digits (got {} characters)",
                text.len()
            )));
        }
        Ok(Token(text.to_ascii_lowercase()))
    }

    /// The token's text (for `MOEFUSE_RENDEZVOUS_TOKEN`).
    ///
    /// ```
    /// let t = moefuse_launch::Token::parse(&"ab".repeat(16))?;
    /// assert_eq!(t.as_str(), "ab".repeat(16));
    /// # Ok::<(), moefuse_launch::LaunchError>(())
    /// ```
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Compares with `offered` in time independent of where they differ.
    pub(crate) fn matches(&self, offered: &str) -> bool {
        let (a, b) = (self.0.as_bytes(), offered.trim().as_bytes());
        let mut diff = (a.len() != b.len()) as u8;
        for (i, &x) in a.iter().enumerate() {
            diff |= x ^ b.get(i).copied().unwrap_or(0).to_ascii_lowercase();
        }
        diff == 0
    }
}

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(<redacted>)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_tokens_differ_and_match_only_themselves() {
        let (a, b) = (Token::generate().unwrap(), Token::generate().unwrap());
        assert_ne!(a, b);
        assert!(a.matches(a.as_str()));
        assert!(a.matches(&a.as_str().to_ascii_uppercase()));
        assert!(!a.matches(b.as_str()));
        assert!(!a.matches(&a.as_str()[..31]));
        assert!(!a.matches(&format!("{}0", a.as_str())));
        assert!(!a.matches(""));
    }

    #[test]
    fn malformed_tokens_are_refused() {
        for bad in ["", "abc", &"g".repeat(32), &"a".repeat(129)] {
            assert!(Token::parse(bad).is_err(), "{bad:?}");
        }
        assert!(Token::parse(&"A1".repeat(16)).is_ok());
    }
}
