//! The gRPC codec: prost's, except that a request that cannot be decoded is
//! the client's error (INVALID_ARGUMENT), not the server's (tonic reports
//! INTERNAL, which clients retry).
use prost::Message;
use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder};
use tonic::Status;
use tonic_prost::{ProstCodec, ProstDecoder, ProstEncoder};

#[derive(Debug, Clone)]
pub struct ValidatingCodec<T, U>(ProstCodec<T, U>);

impl<T, U> Default for ValidatingCodec<T, U> {
    fn default() -> Self {
        Self(ProstCodec::default())
    }
}

impl<T, U> Codec for ValidatingCodec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = ValidatingDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        self.0.encoder()
    }
    fn decoder(&mut self) -> Self::Decoder {
        ValidatingDecoder(self.0.decoder())
    }
}

#[derive(Debug)]
pub struct ValidatingDecoder<U>(ProstDecoder<U>);

impl<U: Message + Default> Decoder for ValidatingDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        self.0.decode(buf).map_err(|s| Status::invalid_argument(format!("malformed message: {}", s.message())))
    }
    fn buffer_settings(&self) -> BufferSettings {
        self.0.buffer_settings()
    }
}
