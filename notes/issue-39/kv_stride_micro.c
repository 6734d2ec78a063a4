#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
// L layers, S tokens, H heads, D=64 int8: token-major [L][S][H][D] vs head-major [L][H][S][D]
int main(int argc,char**argv){
  int L=atoi(argv[1]), S=atoi(argv[2]), H=3, D=64;
  size_t n=(size_t)L*S*H*D+(size_t)64*H*D; int8_t* a=aligned_alloc(64,n); for(size_t i=0;i<n;i++)a[i]=(int8_t)(i*7);
  float q[64]; for(int i=0;i<64;i++)q[i]=i*0.01f;
  float* scores=malloc(sizeof(float)*S);
  for(int mode=0;mode<5;mode++){
    double best=1e9;
    for(int rep=0;rep<5;rep++){
      double t0=now(); float sink=0;
      for(int l=0;l<L;l++) for(int h=0;h<H;h++){
        for(int i=0;i<S;i++){
          const int8_t* row = (mode==0||mode>=3) ? a+(((size_t)l*S+i)*H+h)*D : mode==1 ? a+(((size_t)l*H+h)*S+i)*D : a+((((size_t)l*(S/64)+i/64)*H+h)*64+i%64)*D;
          if(mode>=3){int PD=mode==3?8:32; _mm_prefetch((const char*)(a+(((size_t)l*S+i+PD)*H+h)*D),_MM_HINT_T0);}
          __m512 acc=_mm512_setzero_ps();
          for(int c=0;c<4;c++){ __m512 k=_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(row+16*c))));
            acc=_mm512_fmadd_ps(_mm512_loadu_ps(q+16*c),k,acc);}
          scores[i]=_mm512_reduce_add_ps(acc);
        }
        sink+=scores[S-1];
      }
      double t=now()-t0; if(t<best)best=t; if(sink==12345)puts("x");
    }
    printf("%s: %.2f ms (%.1f GB/s)\n", mode==0?"token-major":mode==1?"head-major":mode==2?"block head-major":mode==3?"token-major pf8":"token-major pf32", best*1e3, n/best/1e9);
  }
}
